"""What CPU this process may keep busy: its affinity mask and its cgroup's quota.

Owns reading them: the affinity mask (`sched_getaffinity`), the CPU quota of
the process's cgroup and of every ancestor up to the mount (cgroup v2
`cpu.max`; cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, found through
/proc/self/cgroup and /proc/self/mountinfo), the host's physical cores, the
operator's override (HICACHE_MP_NODE_CORES), and the throttle counters of
the cgroup whose quota binds (`cpu.stat`: `ThrottleWatch`). Every path is
read under a `root` prefix, so a test can lay a cgroup tree in a directory.
Must not write any cgroup file, start processes or decide worker counts
(hicache_mp.engine.nodebudget does, from `CpuBudget.cpus`).

The rule (decision 89): CPUs = min(host cores, affinity, floor(quota)),
at least 1. Go 1.25's runtime and the JVM take min(affinity, ceil(quota));
Rust's `available_parallelism` floors the quota. Our workers are CPU-bound
copy loops, so a rounded-up CPU is one the cgroup does not have: the whole
cgroup is throttled, and the scheduler with it. Unlike Go 1.25 (which reads
only the leaf cgroup) the tightest quota of the leaf and its ancestors
binds, since the kernel enforces each of them.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

log = logging.getLogger("hicache_mp")

NODE_CORES_ENV = "HICACHE_MP_NODE_CORES"
# What a budget's CPUs came from (CpuBudget.bound_by), for reports that sort
# machines by it: the host's count (physical, or the operator's), or the
# affinity mask or the cgroup quota below it.
BOUNDS = ("physical cores", NODE_CORES_ENV, "affinity", "cgroup quota")


@dataclass(frozen=True)
class Quota:
    """The tightest CPU quota over a cgroup and its ancestors."""
    cpus: float            # quota / period
    version: int           # 1 or 2
    directory: str         # the cgroup directory whose limit binds (its cpu.stat counts the throttling)
    text: str              # the limit as written there, for the log

    def describe(self) -> str:
        name = "cpu.max" if self.version == 2 else "cpu.cfs_quota_us/cpu.cfs_period_us"
        return f"cgroup v{self.version} {name} {self.text} at {self.directory}"


@dataclass(frozen=True)
class CpuBudget:
    """What one process may keep busy, and where that figure came from."""
    cpus: int                   # whole CPUs: min(cores, affinity, floor(quota)), >= 1
    source: str                 # human words, for logs, warnings and metrics()
    host_cores: int             # physical cores of the machine
    affinity: int               # CPUs in the affinity mask
    quota: Quota | None         # the binding quota, or None
    override: bool = False      # HICACHE_MP_NODE_CORES gave `host_cores`
    bound_by: str = "physical cores"  # which limit gave `cpus`: one of BOUNDS

    @property
    def scope(self) -> str:
        """Which engines share this budget: those under one quota, or with one
        affinity mask, or the whole host. Engines of two pods with quotas of their
        own count against each other only for the host's cores (hicache_mp.engine.nodebudget)."""
        if self.quota is not None:
            st = _stat(self.quota.directory)
            return f"cg{self.quota.version}:{st[0]}:{st[1]}" if st else f"cg:{self.quota.directory}"
        if self.affinity < _online_cpus():
            return "cpus:" + ",".join(map(str, sorted(_affinity())))
        return "host"

    def as_dict(self) -> dict:
        return {"cpus": self.cpus, "bound_by": self.bound_by, "source": self.source,
                "host_cores": self.host_cores, "affinity": self.affinity,
                "quota_cpus": None if self.quota is None else round(self.quota.cpus, 3),
                "override": self.override}


def _stat(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _affinity() -> set:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _online_cpus() -> int:
    return os.cpu_count() or 1


def physical_cores() -> int:
    import psutil
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 2


def node_cores_override(environ=None) -> int | None:
    """HICACHE_MP_NODE_CORES as a count, or None where it is unset or empty.
    Whitespace around it is dropped (a value from a ConfigMap file ends in a
    newline); anything but ASCII digits of at least 1 is a ValueError naming it."""
    environ = os.environ if environ is None else environ
    raw = environ.get(NODE_CORES_ENV)
    given = (raw or "").strip()
    if not given:
        return None
    if not (given.isascii() and given.isdigit()) or int(given) < 1:
        raise ValueError(f"{NODE_CORES_ENV}={raw!r}: a core count (>= 1) is needed, "
                         f"e.g. {NODE_CORES_ENV}=8, or unset it to count this machine's cores")
    return int(given)


def read_budget(root: str = "/", *, affinity: int | None = None,
                host_cores: int | None = None, environ=None) -> CpuBudget:
    """This process's budget (`root`, `affinity` and `host_cores` are for tests:
    a cgroup tree laid in a directory, a mask, a machine's size).

    HICACHE_MP_NODE_CORES overrides the host's core count (a node the engine
    would misjudge, or one shared with other work); the affinity mask and the
    quota still cap it, since the kernel enforces them whatever we count."""
    given = node_cores_override(environ)
    host = given or host_cores or physical_cores()
    aff = affinity if affinity is not None else len(_affinity())
    quota = read_quota(root)
    cpus, source = host, f"{NODE_CORES_ENV}={given}" if given else f"{host} physical cores"
    bound = NODE_CORES_ENV if given else "physical cores"
    # A mask of every online CPU is no limit: the host's count stands (physical
    # cores, not hyperthreads, as before; or the operator's).
    if aff < _online_cpus() and aff < cpus:
        cpus, source, bound = aff, f"affinity: {aff} of {_online_cpus()} CPUs", "affinity"
    if quota is not None and math.floor(quota.cpus) < cpus:
        cpus, source, bound = max(1, math.floor(quota.cpus)), quota.describe(), "cgroup quota"
        if quota.cpus < 1:
            source += " (below one CPU: counted as one)"
    return CpuBudget(max(1, cpus), source, host, aff, quota, override=bool(given),
                     bound_by=bound)


# --- cgroups ------------------------------------------------------------------------
def read_text(path: str) -> str | None:
    """A small kernel file's text, or None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _mounts(root: str) -> list[tuple[str, str, str, str]]:
    """(mount point, mount root, fstype, super options) of every cgroup mount."""
    text = read_text(os.path.join(root, "proc/self/mountinfo")) or ""
    out = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((_unescape(fields[4]), _unescape(fields[3]), tail[0], tail[2]))
    return out


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def _cgroup_paths(root: str) -> dict:
    """{controller or '' (v2): path} from /proc/self/cgroup."""
    out = {}
    for line in (read_text(os.path.join(root, "proc/self/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[""] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def _cgroup_dirs(root: str, controller: str = "cpu"):
    """(version, leaf directory, mount point) for each hierarchy with `controller`."""
    paths = _cgroup_paths(root)
    for mount_point, mount_root, fstype, opts in _mounts(root):
        if fstype == "cgroup2":
            path = paths.get("")
        elif controller in opts.split(","):
            path = paths.get(controller)
        else:
            continue
        if path is None:
            continue
        # The mount shows the hierarchy from mount_root down: a container sees
        # its own cgroup as the mount's top, and /proc/self/cgroup may say "/" (a
        # cgroup namespace) or the full host path.
        rel = os.path.relpath(path, mount_root) if path.startswith(mount_root) else "."
        if rel.startswith(".."):
            rel = "."
        leaf = os.path.normpath(os.path.join(root, mount_point.lstrip("/"), rel))
        yield (2 if fstype == "cgroup2" else 1), leaf, os.path.normpath(
            os.path.join(root, mount_point.lstrip("/")))


def _limit(version: int, directory: str) -> tuple[float, str] | None:
    """(CPUs, as written) of one cgroup's own limit, or None (no limit, no file)."""
    if version == 2:
        text = read_text(os.path.join(directory, "cpu.max"))
        if not text:
            return None
        words = text.split()
        if not words or words[0] == "max":
            return None
        try:
            quota, period = int(words[0]), int(words[1]) if len(words) > 1 else 100000
        except ValueError:
            return None
        return (quota / period, f"{quota} {period}") if quota > 0 and period > 0 else None
    q = read_text(os.path.join(directory, "cpu.cfs_quota_us"))
    p = read_text(os.path.join(directory, "cpu.cfs_period_us"))
    try:
        quota, period = int(q), int(p)
    except (TypeError, ValueError):
        return None
    return (quota / period, f"{quota}/{period}") if quota > 0 and period > 0 else None


def cgroup_levels(controller: str, root: str = "/"):
    """(version, directory) of this process's cgroup and of each ancestor up to
    its mount, leaf first, in the v1 hierarchy of `controller` and in the v2 one
    (whose files for it exist only where the controller is on). `root`: a
    cgroup tree laid in a directory, for tests. hicache_mp.engine.checks reads
    the memory limit through it."""
    for version, leaf, top in _cgroup_dirs(root, controller):
        d = leaf
        while True:
            yield version, d
            if d == top or len(d) <= len(top):
                break
            d = os.path.dirname(d)


def read_quota(root: str = "/") -> Quota | None:
    """The tightest quota over this process's cgroup and its ancestors, in every
    hierarchy that has the CPU controller; None where there is none."""
    best = None
    for version, d in cgroup_levels("cpu", root):
        got = _limit(version, d)
        if got and (best is None or got[0] < best.cpus):
            best = Quota(got[0], version, d, got[1])
    return best


def read_throttle(directory: str) -> dict | None:
    """{periods, throttled, throttled_ms} from a cgroup's cpu.stat (v1 or v2), or None."""
    text = read_text(os.path.join(directory, "cpu.stat"))
    if text is None:
        return None
    kv = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) == 2 and words[1].lstrip("-").isdigit():
            kv[words[0]] = int(words[1])
    if "throttled_usec" in kv:
        ms = kv["throttled_usec"] / 1e3
    elif "throttled_time" in kv:   # v1: nanoseconds
        ms = kv["throttled_time"] / 1e6
    else:
        ms = 0.0
    return {"periods": kv.get("nr_periods", 0), "throttled": kv.get("nr_throttled", 0),
            "throttled_ms": ms}


def cpu_seconds(pids) -> dict:
    """{pid: user + system CPU seconds} of live processes (/proc/<pid>/stat);
    a process gone meanwhile is left out."""
    out = {}
    for pid in pids:
        text = read_text(f"/proc/{pid}/stat")
        if not text:
            continue
        fields = text.rpartition(")")[2].split()  # after the command, which may hold spaces
        try:
            out[pid] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (IndexError, ValueError):
            continue
    return out


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ThrottleWatch:
    """The binding cgroup's throttle counters since the engine started, read at
    most once per `interval_s` from the engine's poll; one warning that names
    the fix the first time such a window shows the cgroup throttled in at
    least WARN_SHARE of its periods.

    A throttled cgroup stops every thread in it, the scheduler's with the
    workers: on the H200 box, 14 workers in a 4-CPU quota stalled a busy
    scheduler loop 57-74 ms ten times a second (decision 89).

    Whose work it was decides the fix (decision 98). `pids()` gives the
    workers' process ids: where they used less than IDLE_SHARE of the quota
    in the window, the CPU went to other work in the container (SGLang's
    tokenizer, a sidecar), and the warning says so instead of blaming the
    workers. Where they did use it, the fix named depends on how the count
    was set: fewer workers if explicit; with auto, which already sized them
    from this quota, a higher limit (auto at its one-worker minimum has no
    fewer to give)."""

    # A window warns when at least this share of its periods were throttled.
    # On the H200 box (scripts/bench_quota.py, 8 s windows) the auto-sized
    # engine's cgroup was throttled in 1-3% of its periods with no scheduler
    # gap over 10 ms; a count above the budget, in 17-60%, with 28-81 gaps.
    WARN_SHARE = 0.10
    # Workers that used less than this share of the quota's CPU time in a
    # throttled window did not throttle it (one worker copying flat out in a
    # 4-CPU quota uses 0.25 of it).
    IDLE_SHARE = 0.10

    def __init__(self, budget: CpuBudget, workers: int, *, pids=None, auto: bool = False,
                 interval_s: float = 5.0):
        self.budget = budget
        self.workers = workers
        self.auto = auto
        self.pids = pids
        self.interval_s = interval_s
        self.directory = budget.quota.directory if budget.quota is not None else None
        self.start = read_throttle(self.directory) if self.directory else None
        self.last = self.start
        self.last_at = time.monotonic()
        self.last_cpu = cpu_seconds(pids()) if (pids and self.start) else {}
        self.warned = False

    def _workers_share(self, window_s: float) -> float | None:
        """The workers' CPU seconds in the window over the quota's; None where
        the pids are not known (then the workers are taken to be the cause)."""
        if self.pids is None:
            return None
        now = cpu_seconds(self.pids())
        used = sum(now[p] - self.last_cpu[p] for p in now if p in self.last_cpu)
        self.last_cpu = now
        return used / max(1e-9, window_s * self.budget.quota.cpus)

    def maybe_check(self) -> None:
        if self.warned or self.start is None or \
                time.monotonic() - self.last_at < self.interval_s:
            return  # one warning per engine: metrics() still counts every period
        window_s = time.monotonic() - self.last_at
        self.last_at = time.monotonic()
        now = read_throttle(self.directory)
        if now is None:
            return
        periods = now["periods"] - self.last["periods"]
        throttled = now["throttled"] - self.last["throttled"]
        ms = now["throttled_ms"] - self.last["throttled_ms"]
        self.last = now
        share = self._workers_share(window_s)
        if periods <= 0 or throttled < max(1, self.WARN_SHARE * periods):
            return
        self.warned = True
        what = (f"hicache_mp: this process's cgroup was CPU-throttled in {throttled} of "
                f"{periods} periods ({ms:.0f} ms stopped); a throttled cgroup stops the "
                f"scheduler too. Its CPU budget is {self.budget.cpus} ({self.budget.source})")
        if share is not None and share < self.IDLE_SHARE:
            log.warning("%s, and hicache_mp's %d I/O workers used %.0f%% of it meanwhile: other "
                        "work in this container took the CPU. Raise the container's CPU limit",
                        what, self.workers, 100 * share)
        elif not self.auto:
            log.warning("%s, and its %d I/O workers were busy: use num_workers=0 (auto; "
                        "--hicache-mp-workers 0, or \"num_workers\": 0 in SGLang's extra "
                        "config) or fewer workers, or raise the container's CPU limit",
                        what, self.workers)
        elif self.workers <= 1:
            log.warning("%s, and its I/O worker was busy; auto already runs the minimum of one: "
                        "raise the container's CPU limit", what)
        else:
            log.warning("%s, from which auto gave %d I/O workers, and they were busy, so other "
                        "work shares the budget: give fewer workers (num_workers, "
                        "--hicache-mp-workers), or raise the container's CPU limit",
                        what, self.workers)

    def metrics(self) -> dict:
        """Counters since the engine started (zeros and no cgroup where no quota binds)."""
        out = {"cgroup": self.directory, "periods": 0, "throttled": 0, "throttled_ms": 0.0}
        if self.start is None:
            return out
        now = read_throttle(self.directory) or self.start
        out.update(periods=now["periods"] - self.start["periods"],
                   throttled=now["throttled"] - self.start["throttled"],
                   throttled_ms=round(now["throttled_ms"] - self.start["throttled_ms"], 3))
        return out
