"""A child cgroup with a CPU quota, made for a benchmark or a test and removed after.

Owns making one cgroup (v2: a directory under the cgroup2 mount with
`cpu.max`; v1: under the `cpu` controller's mount with `cpu.cfs_quota_us`),
moving a process into it (`enter`, for a Popen `preexec_fn`, so the process
and everything it starts are in it before they run), and removing it once
its processes are gone. Must not touch any cgroup it did not make; the
product never writes cgroups (hicache_mp.engine.cpubudget only reads them).

`QuotaCgroup.unavailable()` says why a machine cannot have one (not root, no
writable CPU controller), for a skip that names the reason.
"""
from __future__ import annotations

import os
import time

from hicache_mp.engine.cpubudget import read_text, read_throttle

PERIOD_US = 100_000
PREFIX = "hicache_mp_bench."


def _cpu_mounts() -> list[tuple[int, str]]:
    """(version, mount point) of writable CPU hierarchies, v2 first."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 6 or len(tail) < 3 or "rw" not in fields[5].split(","):
            continue
        if tail[0] == "cgroup2":
            controllers = read_text(os.path.join(fields[4], "cgroup.controllers")) or ""
            if "cpu" in controllers.split():
                out.append((2, fields[4]))
        elif tail[0] == "cgroup" and "cpu" in tail[2].split(","):
            out.append((1, fields[4]))
    return sorted(out, key=lambda m: -m[0])


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def ours_left() -> set[str]:
    """Every cgroup this module made that is still there (for a check that
    nothing was left behind)."""
    out = set()
    for _, mount in _cpu_mounts():
        try:
            out |= {os.path.join(mount, n) for n in os.listdir(mount) if n.startswith(PREFIX)}
        except OSError:
            pass
    return out


def remove_cgroup(path: str, timeout_s: float = 10.0) -> None:
    """rmdir a cgroup this code made, once its processes are gone (they must
    be ending: a cgroup with a process in it refuses rmdir with EBUSY)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class QuotaCgroup:
    """`with QuotaCgroup(4.0) as cg: Popen(..., preexec_fn=cg.enter)`."""

    def __init__(self, cpus: float, *, name: str | None = None):
        mounts = _cpu_mounts()
        if not mounts:
            raise OSError("no writable cgroup hierarchy with the CPU controller")
        self.version, mount = mounts[0]
        self.cpus = cpus
        self.path = os.path.join(mount, name or f"{PREFIX}{os.getpid()}.{time.monotonic_ns()}")
        quota = max(1000, int(round(cpus * PERIOD_US)))
        if self.version == 2:
            ctl = os.path.join(mount, "cgroup.subtree_control")
            if "cpu" not in (read_text(ctl) or "").split():
                _write(ctl, "+cpu")  # the mount's top: the no-internal-process rule spares it
        os.mkdir(self.path)
        try:
            if self.version == 2:
                _write(os.path.join(self.path, "cpu.max"), f"{quota} {PERIOD_US}")
            else:
                _write(os.path.join(self.path, "cpu.cfs_period_us"), str(PERIOD_US))
                _write(os.path.join(self.path, "cpu.cfs_quota_us"), str(quota))
        except BaseException:
            os.rmdir(self.path)
            raise
        self._procs = os.path.join(self.path, "cgroup.procs")

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot make one, or None."""
        if os.geteuid() != 0:
            return "making a cgroup needs root"
        if not _cpu_mounts():
            return "no writable cgroup hierarchy with the CPU controller is mounted"
        return None

    def enter(self) -> None:
        """Move the calling process into the cgroup (a Popen preexec_fn)."""
        _write(self._procs, str(os.getpid()))

    def stat(self) -> dict:
        """The cgroup's own throttle counters (hicache_mp.engine.cpubudget.read_throttle)."""
        return read_throttle(self.path) or {}

    def close(self, timeout_s: float = 10.0) -> None:
        """Remove the cgroup once its processes are gone (they must be ending)."""
        remove_cgroup(self.path, timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
