"""Input checks of the engine's public calls: raised before anything is reserved.

Owns what a bad argument is (a timeout, a pool size, a list of host slots)
and the one clear ValueError it gets, and the memory a pool may take: the
machine's, and the limit of this process's memory cgroup (`memory_limit`,
read through hicache_mp.engine.cpubudget's cgroup paths). Must not touch
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


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest memory limit over this process's cgroup and its ancestors."""
    nbytes: int
    version: int       # 1 or 2
    directory: str     # the cgroup whose limit binds

    @property
    def file(self) -> str:
        return "memory.max" if self.version == 2 else "memory.limit_in_bytes"


def memory_limit(root: str = "/") -> MemoryLimit | None:
    """This process's memory cgroup limit (the tightest of its cgroup and every
    ancestor, each enforced by the kernel), or None where none is set or none
    can be read. `root`: a cgroup tree laid in a directory, for tests."""
    best = None
    for version, d in cgroup_levels("memory", root):
        name = "memory.max" if version == 2 else "memory.limit_in_bytes"
        text = (read_text(os.path.join(d, name)) or "").strip()
        if not text.isdigit() or int(text) >= _NO_LIMIT:
            continue  # "max", no such file (no memory controller here), or v1's "none"
        if best is None or int(text) < best.nbytes:
            best = MemoryLimit(int(text), version, d)
    return best


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
    swap is slow, not lost). `root`: see `memory_limit`.
    """
    swap = psutil.swap_memory().total
    limit = psutil.virtual_memory().total + swap
    if nbytes > limit:
        raise ValueError(f"a host pool of {nbytes / 2**30:.1f} GiB does not fit in this machine's "
                         f"memory ({limit / 2**30:.1f} GiB): lower host_pool_pages or the page size")
    cg = memory_limit(root)
    if cg is not None and nbytes > cg.nbytes + swap:
        plus = f" and {_size(swap)} of swap" if swap else ""
        raise ValueError(
            f"a host pool of {_size(nbytes)} does not fit in this process's memory limit "
            f"({_size(cg.nbytes)}{plus}: cgroup v{cg.version} {cg.file} at {cg.directory}). "
            f"The pool is shared memory, charged to that limit, so the kernel would OOM-kill "
            f"the process while the pool is made. Fix: lower host_pool_pages or the page size, "
            f"or raise the container's memory limit (Kubernetes resources.limits.memory, "
            f"docker run --memory), leaving room for the server's own memory too")


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
