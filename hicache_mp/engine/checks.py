"""Input checks of the engine's public calls: raised before anything is reserved.

Owns what a bad argument is (a timeout, a pool size, a list of host slots)
and the one clear ValueError it gets, and the memory an engine may take: the
machine's, the limit of this process's memory cgroup, and the room that limit
still leaves (`memory_limits`: limit, usage and reclaimable file cache at each
level, read through hicache_mp.engine.cpubudget's cgroup paths). Must not touch
engine state or write a cgroup file: each check is a function of its
arguments and of what the kernel says. The slot check runs on the
scheduler's thread, so it keeps the GIL (shm.gilkeep: min/max in Python, no
numpy reduction).
"""
import math
import os
from dataclasses import dataclass

import numpy as np
import psutil

from shm import gilkeep

from .cpubudget import cgroup_levels, read_text

# cgroup v1 writes "no limit" as its largest counter (9223372036854771712 with
# 4 KiB pages); v2 writes "max". Any limit this large is none.
_NO_LIMIT = 1 << 62


# What an engine's start adds to the memory cgroup besides its shared memory
# (decision 107), measured in a v1 memory cgroup as the peak usage less the
# usage before and the segments: about 21 MiB + 18 MiB per worker (39, 57 and
# 93 MiB with 1, 2 and 4 workers). Counted with a margin: PROCESS_BYTES for
# each child process that lives with the engine (an I/O worker, the
# evictor: its interpreter and imports), ENGINE_BYTES once (the engine's own
# process growing, and the short-lived process of the start-up store scan).
PROCESS_BYTES = 24 << 20
ENGINE_BYTES = 24 << 20


@dataclass(frozen=True)
class MemoryLimit:
    """The memory limit of one cgroup over this process (its own or an
    ancestor's), with what that cgroup already uses. `usage`: memory.current
    (v2) or memory.usage_in_bytes (v1), None where unreadable; `inactive_file`:
    the file cache on its inactive list (memory.stat `inactive_file`, v1
    `total_inactive_file`), which the kernel reclaims before it OOM-kills;
    `swap`: the swap this cgroup still lets its memory spill to (v2
    memory.swap.max less memory.swap.current; v1 memory.memsw.limit_in_bytes
    less the memory limit), None where it sets no bound (the machine's swap
    is then the bound)."""
    nbytes: int
    version: int       # 1 or 2
    directory: str     # the cgroup whose limit binds
    usage: int | None = None
    inactive_file: int = 0
    swap: int | None = None

    @property
    def file(self) -> str:
        return "memory.max" if self.version == 2 else "memory.limit_in_bytes"

    @property
    def usage_file(self) -> str:
        return "memory.current" if self.version == 2 else "memory.usage_in_bytes"

    @property
    def in_use(self) -> int:
        """What the cgroup holds that the kernel cannot simply drop: its usage
        less its inactive file cache (what Kubernetes calls the working set)."""
        return max(0, (self.usage or 0) - self.inactive_file)

    @property
    def room(self) -> int:
        """What can still be charged to this cgroup's memory before the kernel
        swaps or OOM-kills."""
        return self.nbytes - self.in_use

    def swap_room(self, machine_swap: int) -> int:
        """The swap this cgroup may still use on a machine with `machine_swap`."""
        return machine_swap if self.swap is None else min(machine_swap, self.swap)


def _int(text) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def _stat_value(text, name: str) -> int:
    for line in (text or "").splitlines():
        words = line.split()
        if len(words) == 2 and words[0] == name and words[1].isdigit():
            return int(words[1])
    return 0


def memory_limits(root: str = "/") -> list:
    """A MemoryLimit for each cgroup over this process that sets one (its own
    and every ancestor's, each enforced by the kernel on everything below it),
    leaf first; none where none is set or none can be read. `root`: a cgroup
    tree laid in a directory, for tests."""
    out = []
    for version, d in cgroup_levels("memory", root):
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        limit = _int(read_text(os.path.join(d, name)))
        if limit is None or limit >= _NO_LIMIT:
            continue  # "max", no such file (no memory controller here), or v1's "none"
        usage = _int(read_text(os.path.join(
            d, "memory.current" if version == 2 else "memory.usage_in_bytes")))
        # memory.stat counts the cgroup and its descendants, as the usage does
        # (v2 always; v1 in its total_* lines)
        inactive = _stat_value(read_text(os.path.join(d, "memory.stat")),
                               "inactive_file" if version == 2 else "total_inactive_file")
        out.append(MemoryLimit(limit, version, d, usage, min(inactive, usage or 0),
                               _swap_bound(version, d, limit)))
    return out


def _swap_bound(version: int, d: str, limit: int) -> int | None:
    """The swap a cgroup still allows (see MemoryLimit.swap), None for no bound."""
    if version == 2:
        most = _int(read_text(os.path.join(d, "memory.swap.max")))
        if most is None or most >= _NO_LIMIT:
            return None
        return max(0, most - (_int(read_text(os.path.join(d, "memory.swap.current"))) or 0))
    both = _int(read_text(os.path.join(d, "memory.memsw.limit_in_bytes")))
    return None if both is None or both >= _NO_LIMIT else max(0, both - limit)


def memory_limit(root: str = "/") -> MemoryLimit | None:
    """The memory limit that binds this process: of its cgroup and every
    ancestor's, the one with the least room left (`MemoryLimit.room`; with no
    usage read, the tightest limit). None where none is set or can be read."""
    return min(memory_limits(root), key=lambda m: (m.room, m.nbytes), default=None)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def check_pool_size(nbytes: int, root: str = "/") -> None:
    """An absurd pool size is a ValueError here, before anything is allocated.

    Whatever backs the host pool (a /dev/shm segment, or a region handed over
    by fd), it needs that much memory; a segment created by the engine is also
    checked against /dev/shm's free space (`shm.hostpool`). Shared memory is
    charged to the memory cgroup of the process that makes it, so a pool over
    the cgroup's limit gets the process OOM-killed while the pool is made,
    with no message: refused here instead, naming the limit. Swap the machine
    has counts, as for the machine's memory (a pool that would fit only in
    swap is slow, not lost), within what the cgroup lets it use (v2
    memory.swap.max, v1 memory.memsw.limit_in_bytes: Kubernetes pods
    usually get none). What the process already uses is weighed later,
    with the engine's other memory, by `check_memory_room`. `root`: see
    `memory_limit`.
    """
    swap = psutil.swap_memory().total
    limit = psutil.virtual_memory().total + swap
    if nbytes > limit:
        raise ValueError(f"a host pool of {nbytes / 2**30:.1f} GiB does not fit in this machine's "
                         f"memory ({limit / 2**30:.1f} GiB): lower host_pool_pages or the page size")
    cg = min(memory_limits(root), key=lambda m: m.nbytes + m.swap_room(swap), default=None)
    if cg is not None and nbytes > cg.nbytes + cg.swap_room(swap):
        swap = cg.swap_room(swap)
        plus = f" and {_size(swap)} of swap" if swap else ""
        raise ValueError(
            f"a host pool of {_size(nbytes)} does not fit in this process's memory limit "
            f"({_size(cg.nbytes)}{plus}: cgroup v{cg.version} {cg.file} at {cg.directory}). "
            f"The pool is shared memory, charged to that limit, so the kernel would OOM-kill "
            f"the process while the pool is made. Fix: lower host_pool_pages or the page size, "
            f"or raise the container's memory limit (Kubernetes resources.limits.memory, "
            f"docker run --memory), leaving room for the server's own memory too")


def check_memory_room(parts, processes: int = 0, *, fixes=(), root: str = "/") -> None:
    """ValueError if what an engine is about to charge to this process's memory
    cgroup does not fit in what the limit leaves (decision 107), raised before
    any of it is made. `parts`: the shared memory it will make, (key, label,
    bytes) each (resources.shm_parts: the host pool unless the caller's, the
    control block, the rings); `processes`: the child processes it will start
    (workers, the evictor), PROCESS_BYTES each; `fixes`: what the caller can
    change, said after the limit's own fix.

    At every level of the hierarchy that sets a limit, the room is the limit
    less the usage, less the inactive file cache in that usage (reclaimable:
    a pod that only read many files is not refused); the least room binds.
    The engine's segments are shared memory (tmpfs), charged to the cgroup of
    the process that first touches each page: the engine allocates them in
    full when it makes them (decision 40), so this process's cgroup. Swap
    counts as in check_pool_size: the machine's, within what the cgroup
    allows (MemoryLimit.swap).
    """
    need = sum(n for _, _, n in parts) + processes * PROCESS_BYTES
    levels = memory_limits(root)
    if not levels or need == 0:
        return
    machine_swap = psutil.swap_memory().total
    cg = min(levels, key=lambda m: (m.room + m.swap_room(machine_swap), m.nbytes))
    swap = cg.swap_room(machine_swap)
    if need <= cg.room + swap:
        return
    what = ", ".join(f"{label} {_size(n)}" for _, label, n in parts if n)
    if processes:
        what += (f", {processes} process{'es' if processes > 1 else ''} to start (about "
                 f"{_size(PROCESS_BYTES)} each)")
    usage = "unreadable" if cg.usage is None else \
        f"{cg.usage_file} {_size(cg.usage)}, less {_size(cg.inactive_file)} of inactive " \
        f"file cache the kernel can reclaim"
    plus = f", with {_size(swap)} of swap besides" if swap else ""
    raise ValueError(
        f"this engine needs {_size(need)} of memory ({what}), but the memory limit leaves "
        f"{_size(max(0, cg.room))}: a limit of {_size(cg.nbytes)} (cgroup v{cg.version} "
        f"{cg.file} at {cg.directory}) of which {_size(cg.in_use)} is already in use "
        f"({usage}){plus}. The pool and rings are shared memory, charged to that limit as "
        f"they are made, so the kernel would OOM-kill the process while they are made, with "
        f"no message. Fix: " + "; ".join([*fixes,
            f"{'or ' if fixes else ''}raise the container's memory limit (Kubernetes "
            f"resources.limits.memory, docker run --memory) to at least "
            f"{_size(cg.in_use + need)} plus what the server still takes after this engine "
            f"starts"]))


def check_timeout(timeout_s, name: str = "timeout_s"):
    """A timeout in seconds as a float, or None for none (None or inf);
    ValueError for anything else: a string, a bool, a negative number, NaN."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"{name} must be a number of seconds or None, got {timeout_s!r}")
    if not timeout_s >= 0:  # also NaN
        raise ValueError(f"{name} must be >= 0 (or None / inf for no timeout), got {timeout_s!r}")
    return None if math.isinf(timeout_s) else float(timeout_s)


def check_pages(host_pages, nkeys: int, limit: int) -> np.ndarray:
    """`host_pages` as int64 slots for an op of `nkeys` keys in a pool of
    `limit` pages; ValueError for anything else (before anything is reserved)."""
    try:
        pages = np.asarray(host_pages)
    except Exception as exc:
        raise ValueError(f"host_pages must be a sequence of ints: {exc}") from None
    if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "iu"):
        raise ValueError(f"host_pages must be a 1-D sequence of ints, got dtype {pages.dtype} "
                         f"shape {pages.shape}")
    listed = pages.tolist()  # min/max in Python: numpy's reductions may let the GIL go
    if pages.size and pages.dtype.kind == "u" and max(listed) > np.iinfo(np.int64).max:
        raise ValueError(f"host page {max(listed)} out of range")  # before the cast wraps it
    pages = pages.astype(np.int64, copy=False)
    if len(pages) != nkeys:
        raise ValueError(f"{nkeys} keys but {len(pages)} host pages")
    if len(pages) > limit:
        raise ValueError(f"op of {len(pages)} pages exceeds the host pool ({limit} pages)")
    if len(pages):
        lo, hi = min(listed), max(listed)
        if lo < 0 or hi >= limit:
            raise ValueError(f"host page {lo if lo < 0 else hi} out of range [0, {limit})")
        if gilkeep.repeats(pages):
            raise ValueError("host pages repeat within one op")
    return pages


def check_parts(parts, nkeys: int, read_parts: int) -> np.ndarray | None:
    """The layer group each position of a read reads (decision 101), as uint64
    (the records' io_ns on submission): required with `read_parts` > 1, each
    in [0, read_parts); refused on an engine that reads whole pages."""
    if read_parts == 1:
        if parts is not None:
            raise ValueError("parts= needs an engine built with read_parts > 1")
        return None
    if parts is None:
        raise ValueError(f"this engine reads pages in {read_parts} layer groups: "
                         "prefetch(keys, host_pages, parts=[group per position])")
    try:
        arr = np.asarray(parts)
    except Exception as exc:
        raise ValueError(f"parts must be a sequence of ints: {exc}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu") or len(arr) != nkeys:
        raise ValueError(f"parts must be {nkeys} ints, one per key, got {arr.dtype} {arr.shape}")
    listed = arr.tolist()  # min/max in Python: numpy's reductions may let the GIL go
    if listed and (min(listed) < 0 or max(listed) >= read_parts):
        raise ValueError(f"parts must lie in [0, {read_parts}), got {min(listed)}..{max(listed)}")
    return arr.astype(np.uint64)
