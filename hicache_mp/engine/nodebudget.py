"""The node-wide worker budget that engines with `num_workers=0` (auto) share.

Owns the node registry: /dev/shm/hicache_mp-node/, one small file per live
engine holding its worker count, each kept flock'ed by its engine for the
engine's life. A file whose lock can be taken belongs to a dead engine (the
kernel drops flocks with the process) and is removed by the next engine that
looks; the directory goes when its last engine leaves. Registration runs
under a flock on the directory itself, so two engines starting together see
each other. Must not start processes or touch anything but that directory.

The budget (decision 89): the CPUs this process may keep busy
(hicache_mp.engine.cpubudget: physical cores, the affinity mask and the cgroup's
CPU quota, or HICACHE_MP_NODE_CORES), less `scheduler_cores` per engine for
its scheduler's process, split evenly over the engines expected to share
it: the larger of `node_engines` (SGLang's adapter passes its node-local rank
count, so every TP rank computes the same share whatever order they start
in) and the engines registered under the same budget plus this one. An
engine never takes more than what the live ones left free, and always at
least one worker. Engines already running keep their count: a later engine
that was not announced by `node_engines` gets what is left (decision 42).

Each entry names its budget's scope (the quota's cgroup, the affinity mask,
or the host). Engines of one scope split that budget; engines of every scope
also split the host's physical cores. So engines of one pod share the pod's
quota, and pods whose registries meet (HICACHE_MP_NODE_DIR on a hostPath)
also share the node, each still capped by its own quota.

An auxiliary engine (`aux_cap`: a hybrid model's sidecar-pool engine, in the
same process as its rank's KV engine, so no scheduler core of its own) is
no engine in that count: it takes at most `aux_cap` workers from what the
others left free (at least one), and its workers count as taken for every
engine registering after it.

An engine with an explicit `num_workers` registers too (decision 98): its
count is the user's word, but it uses CPUs of the same budget, so an auto
engine starting later must see them, and the sum over the budget's engines
is what throttles a pod. Its registration is best effort: a registry it
cannot use costs it nothing (an explicit count is the documented way around
an unusable one).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass

from shm.owner import same_file, unlink_and_release
from workers.control import MAX_WORKERS

from .cpubudget import NODE_CORES_ENV, CpuBudget, read_budget  # noqa: F401 (NODE_CORES_ENV: API)

NODE_DIR = "/dev/shm/hicache_mp-node"
# Cores kept per engine for the process it serves: the scheduler's loop, and
# the storage threads beside it (SGLang's prefetch, I/O and backup threads),
# which wake for every batch. With one core kept, the workers filled the rest,
# and under load the kernel descheduled a thread that held the GIL: through
# SGLang's controller on the 16-core H200 box the busy scheduler lost 25 ms
# per 2 GiB round at 15 workers, 10 ms at 13 and 7 ms at 11, and reads beside
# a write-through kept 0.67 / 0.85 / 0.82 of their GB/s (decision 64).
SCHEDULER_CORES = 2
# In a budget of at most this many CPUs, an engine keeps one core, not two:
# under a CPU quota every CPU the workers may use is one the scheduler's cgroup
# pays for, and the workers plus one busy scheduler thread must fit in it or the
# whole cgroup is throttled (decision 89, measured with scripts/bench_quota.py).
SMALL_BUDGET_CPUS = 8
# Overrides, read when an engine registers: the registry's directory (one per
# node by default), and the core count (a container whose CPU quota is below
# the host's core count should say what it has).
NODE_DIR_ENV = "HICACHE_MP_NODE_DIR"
# The registry is shared by every user's engines: the directory is
# world-writable with the sticky bit, as /dev/shm and /tmp are (anyone adds an
# entry, only its owner removes it), and each entry is readable by all, since
# an engine flocks the others' entries through a read-only descriptor.
DIR_MODE = 0o1777
ENTRY_MODE = 0o644
# How long an engine waits for the directory's maker (another user's engine)
# to give it DIR_MODE: mkdir applies the umask, so it is made, then chmod'ed.
DIR_MODE_WAIT_S = 1.0

log = logging.getLogger("hicache_mp")


def node_dir() -> str:
    return os.environ.get(NODE_DIR_ENV) or NODE_DIR


def physical_cores() -> int:
    """The CPUs one process here may keep busy (hicache_mp.engine.cpubudget)."""
    return read_budget().cpus


def scheduler_cores(cpus: int) -> int:
    """Cores each engine keeps for its scheduler's process, in a budget of
    `cpus` (decisions 64, 89)."""
    return 1 if cpus <= SMALL_BUDGET_CPUS else SCHEDULER_CORES


def _held(path: str) -> bool:
    """True while the engine that owns `path` lives (it holds the file's flock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except PermissionError:
        return True  # another user's, made unreadable (an older engine's umask): cannot tell
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)
    return False


def _read_entry(path: str) -> tuple[int, bool, str]:
    """(workers, auxiliary?, budget scope) of one registry file: "N [aux] [scope=S]"
    (an entry of an older engine names no scope: the host's)."""
    try:
        with open(path) as f:
            words = f.read().split()
        scope = next((w[6:] for w in words[1:] if w.startswith("scope=")), "host")
        return int(words[0]), "aux" in words[1:], scope
    except (OSError, ValueError, IndexError):
        return 0, False, "host"


def _read_workers(path: str) -> int:
    return _read_entry(path)[0]


def _live_entries(node_dir: str) -> dict[str, tuple[int, bool, str]]:
    return {name: _read_entry(os.path.join(node_dir, name)) for name in live_shares(node_dir)}


def live_shares(node_dir: str, *, prune: bool = True) -> dict[str, int]:
    """{entry: workers} of the live engines (auxiliary ones too); dead engines'
    entries are removed."""
    out = {}
    try:
        names = os.listdir(node_dir)
    except FileNotFoundError:
        return out
    for name in names:
        path = os.path.join(node_dir, name)
        if _held(path):
            out[name] = _read_workers(path)
        elif prune:
            try:
                os.unlink(path)
            except (FileNotFoundError, PermissionError):
                pass  # gone, or another user's (the sticky bit): it counts for nothing anyway
    return out


def remove_if_empty(node_dir: str) -> None:
    """The registry directory, removed once no engine is registered in it (a
    closing engine's last step; never an error). Under the directory's lock,
    so no engine is between its look and its registration; rmdir fails while
    any other engine is registered."""
    try:
        dfd = os.open(node_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        if same_file(dfd, node_dir):
            os.rmdir(node_dir)
    except OSError:
        pass
    finally:
        os.close(dfd)


def budget_share(cores: int, engines: int, taken: int) -> int:
    """Workers for one more engine: an even share of (cores - scheduler_cores
    per engine), no more than what the others left free, at least one, at
    most MAX_WORKERS (a host of more cores than an engine may have workers)."""
    budget = cores - scheduler_cores(cores) * engines
    share = budget // engines
    return min(MAX_WORKERS, max(1, min(share, budget - taken)))


def _aux_share(cores: int, engines: int, taken: int, cap: int) -> int:
    return min(MAX_WORKERS, max(1, min(cap, cores - scheduler_cores(cores) * engines - taken)))


@dataclass(frozen=True)
class Split:
    """One budget as this engine found it: `cpus` shared by `engines` engines
    (this one included), of whose workers the others run `taken`."""
    cpus: int
    engines: int
    taken: int

    def room(self) -> int:
        """Workers the budget holds beside its engines' schedulers."""
        return self.cpus - scheduler_cores(self.cpus) * self.engines


class NodeBudget:
    """One engine's registration; `workers` is its share. close() frees it."""

    def __init__(self, node_engines: int = 0, *, directory: str | None = None,
                 cores: int | None = None, aux_cap: int | None = None,
                 budget: CpuBudget | None = None, before_register=None,
                 explicit: int | None = None):
        """`cores`: a machine of that many cores, no quota (tests); else `budget`,
        else this process's (hicache_mp.engine.cpubudget). `before_register(workers)`
        runs with the share decided and nothing registered yet (the engine's room
        check): what it raises leaves no entry behind. `explicit`: the user's
        worker count, registered as it is (best effort) instead of a share.

        After it: `workers`; `engines`, the engines counted in this budget;
        `split`, the tightest budget (over_by() and floored() read it);
        `registered`, False where an explicit engine could not register."""
        self.node_dir = where = directory or node_dir()
        self.path = None
        self._fd = -1
        self.explicit = explicit
        if cores:
            budget = CpuBudget(int(cores), f"{cores} cores (given)", int(cores), int(cores), None)
        self.budget = budget = budget or read_budget()
        self.cores = budget.cpus
        self.aux = bool(aux_cap)
        try:
            self._join(where, budget, int(node_engines or 0), aux_cap, before_register)
        except _Refused as refused:
            raise refused.error
        except OSError as exc:
            if explicit is None:
                raise _registry_error(where, exc) from None
            # An explicit count needs no share: run without the registry, as before.
            # It is still measured against its own budget, alone in it.
            self.workers, self.engines, self.split = explicit, 1, Split(budget.cpus, 1, 0)
            self.registered = False
            log.info("hicache_mp: num_workers=%d not registered in the node registry %s (%s): "
                     "engines with auto workers will not count them", explicit, where, exc)
            if before_register is not None:
                before_register(explicit)

    def _join(self, where, budget, node_engines, aux_cap, before_register) -> None:
        scope = budget.scope
        host = max(budget.host_cores, budget.cpus)
        for _ in range(20):  # the directory may vanish between makedirs and open
            _make_shared_dir(where)
            try:
                dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX)
                if not same_file(dfd, where):  # removed (and maybe re-made) meanwhile
                    continue
                live = list(_live_entries(where).values())
                # Two splits: this budget's among the engines under it, and the
                # host's cores among every engine registered here; the tighter wins.
                if scope == "host":   # the widest budget: every engine here counts
                    splits = [(budget.cpus, live)]
                else:
                    splits = [(budget.cpus, [e for e in live if e[2] == scope]), (host, live)]
                self.workers = self.split = None
                for cpus, entries in splits:
                    taken = sum(w for w, _, _ in entries)
                    schedulers = sum(1 for _, aux, _ in entries if not aux)
                    if aux_cap:
                        engines = max(schedulers, node_engines, 1)
                        share = _aux_share(cpus, engines, taken, int(aux_cap))
                    else:
                        engines = max(schedulers + 1, node_engines)
                        share = budget_share(cpus, engines, taken)
                    split = Split(cpus, engines, taken)
                    if self.explicit is not None:
                        share = self.explicit
                        tighter = self.split is None or split.room() - split.taken < \
                            self.split.room() - self.split.taken
                    else:
                        tighter = self.workers is None or share < self.workers
                    if self.split is None:
                        self.engines = engines
                    if tighter:
                        self.split = split
                    self.workers = share if self.workers is None else min(self.workers, share)
                if before_register is not None:
                    try:
                        before_register(self.workers)
                    except BaseException as exc:
                        # under the directory's lock, as close() does: the
                        # directory goes if no other engine is registered
                        with contextlib.suppress(OSError):
                            os.rmdir(where)
                        raise _Refused(exc) from None  # the engine's, not the registry's
                self._register(aux=bool(aux_cap), scope=scope)
                self.registered = True
                return
            finally:
                os.close(dfd)
        raise RuntimeError(f"hicache_mp: cannot register in {where}")

    def over_by(self) -> int:
        """Workers this budget's engines run beyond its room, this one's
        included (0 where they fit, or where nothing was registered)."""
        s = self.split
        return 0 if s is None else max(0, s.taken + self.workers - max(0, s.room()))

    def floored(self) -> bool:
        """An auto engine that got its one worker only because it never gets
        none: its budget had no CPU left for it."""
        s = self.split
        return self.explicit is None and not self.aux and s is not None and \
            min(s.room() // s.engines, s.room() - s.taken) < 1

    def _register(self, aux: bool, scope: str = "host") -> None:
        path = os.path.join(self.node_dir, f"{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, ENTRY_MODE)
        try:
            os.fchmod(fd, ENTRY_MODE)  # whatever the umask: every user's engine reads and flocks it
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{self.workers}{' aux' if aux else ''} scope={scope}\n".encode())
        except BaseException:
            # A full /dev/shm fails the write: an entry left behind, flock'ed by
            # this live process, would count its workers against every later engine.
            os.unlink(path)
            os.close(fd)
            raise
        self.path, self._fd = path, fd

    def close(self) -> None:
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        unlink_and_release(fd, self.path)  # never an error from close
        remove_if_empty(self.node_dir)


class _Refused(Exception):
    """The engine's own check (`before_register`) refused: its error goes on
    as it is, never taken for the registry's."""

    def __init__(self, error: BaseException):
        super().__init__(error)
        self.error = error


def _registry_error(where: str, exc: OSError) -> OSError:
    """What an auto engine raises for a registry it cannot use: the error
    itself where it already names the fix (_make_shared_dir), else one that
    names the directory, the variable and the ways out."""
    if isinstance(exc, PermissionError) and "hicache_mp" in str(exc):
        return exc
    err = OSError(exc.errno, f"hicache_mp: the node registry {where}, where engines with auto "
                  f"workers (num_workers=0) share the CPU budget, cannot be used "
                  f"({exc.strerror or exc}). Point {NODE_DIR_ENV} at a directory this user "
                  f"can write (on a tmpfs such as /dev/shm), or give num_workers "
                  f"(--hicache-mp-workers) explicitly")
    err.filename = where
    return err


def _make_shared_dir(where: str) -> None:
    """The registry directory, made (or found) with DIR_MODE. One made by
    another user without write permission for us (an older hicache_mp made it
    0755) is a PermissionError that says what to do."""
    os.makedirs(where, exist_ok=True)
    deadline = time.monotonic() + DIR_MODE_WAIT_S
    while True:
        try:
            st = os.stat(where)
        except FileNotFoundError:
            return  # removed by its last engine meanwhile: the caller's loop makes it again
        if stat.S_IMODE(st.st_mode) == DIR_MODE:
            return
        if st.st_uid == os.geteuid():
            os.chmod(where, DIR_MODE)
            return
        if os.access(where, os.W_OK | os.X_OK) and st.st_mode & stat.S_ISVTX:
            return  # shared as well, by another rule: fine
        if time.monotonic() > deadline:
            raise PermissionError(
                errno.EACCES, f"hicache_mp: the node registry {where} is mode "
                f"{stat.S_IMODE(st.st_mode):o} and owned by uid {st.st_uid}, so this engine "
                f"(uid {os.geteuid()}) cannot register its workers there (an older hicache_mp "
                f"made it). Remove the directory once no engine runs, point {NODE_DIR_ENV} at "
                f"a directory of your own, or give num_workers (--hicache-mp-workers) explicitly")
        time.sleep(0.01)  # its maker is between mkdir and chmod
