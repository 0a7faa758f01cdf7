"""The fresh interpreters test_sglang_plugin.py reads: SGLang's plugin loader
without the opt-in, with another version, SGLang's scheduler process, and the
`hicache-mp sglang-serve -- --help` alias; and the one whose fast runs
test_sglang_fastpath.py compares with stock (the plugin route, mode `on`,
started alone by `start_route_early`). Each is mostly SGLang's import on
one core, so tests/conftest.py starts them when the session starts (as it
starts test_imports' check), beside the collection and the tests before
them on the other core; the test module's fixture starts them itself when
the session did not, and `stop_early()` ends whatever is left.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import early  # tests/early.py: nice 19, marked, on what the tests leave idle

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "fastpath_plugin_child.py")

_early: list = []
_route: list = []


class Child:
    """One fresh interpreter of fastpath_plugin_child.py in `mode`, started at
    once; `report()` waits for it and reads what it wrote."""

    def __init__(self, mode: str, tmp_path: str, opt_in: bool, timeout: int = 240):
        env = {k: v for k, v in os.environ.items() if k not in ("HICACHE_MP_FASTPATH",
                                                                 "SGLANG_PLUGINS")}
        if opt_in:
            env["HICACHE_MP_FASTPATH"] = "1"
        env["TMPDIR"] = tmp_path   # SGLang's ipc files (PortArgs) stay in the test's dir
        # its processes are its test's to check (early.left_behind), not the guard's
        env[early.MARK] = self.mark = f"plugin-{mode}:{os.getpid()}"
        self.tmp_path, self.timeout = tmp_path, timeout
        self.out = os.path.join(tmp_path, f"{mode}.json")
        self.err = open(os.path.join(tmp_path, f"{mode}.stderr"), "w+")
        # a session of its own: stop() ends what it started too (the scheduler
        # mode runs SGLang's scheduler entry as its child)
        self.proc = early.background(subprocess.Popen(
            [sys.executable, CHILD, mode, self.out, tmp_path], env=env,
            stdout=subprocess.DEVNULL, stderr=self.err, text=True, start_new_session=True))

    def report(self) -> dict:
        try:
            self.proc.wait(self.timeout)
        finally:
            self.stop()
            self.err.seek(0)
            stderr = self.err.read()
        assert self.proc.returncode == 0, stderr[-3000:]
        left = early.left_behind(self.mark)
        assert not left, f"the {self.mark} child left processes or shared memory behind: {left}"
        with open(self.out) as f:
            report = json.load(f)
        with open(os.path.join(self.tmp_path, "plugins.log")) as f:
            report["log"] = f.read()
        report["stderr"] = stderr
        return report

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


class Alias:
    """`python -m hicache_mp sglang-serve -- --help`, which execs SGLang's launcher."""

    def __init__(self, tmp_path: str):
        env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS",
                                                                 "HICACHE_MP_FASTPATH")}
        self.files = [open(os.path.join(tmp_path, f"alias.{n}"), "w+") for n in ("out", "err")]
        self.proc = early.background(subprocess.Popen(
            [sys.executable, "-m", "hicache_mp", "sglang-serve", "--", "--help"], env=env,
            stdout=self.files[0], stderr=self.files[1], text=True))

    def result(self, timeout: int = 240) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout)
        finally:
            self.stop()
        out = []
        for f in self.files:
            f.seek(0)
            out.append(f.read())
        return self.proc.returncode, out[0], out[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Started:
    """All four, started together in a directory of their own."""

    def __init__(self):
        self.shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("sglang")}
        self.base = tempfile.mkdtemp(prefix="hicache_mp-plugin-")

        def where(name):
            d = os.path.join(self.base, name)
            os.mkdir(d)
            return d
        self.children = {"off": Child("off", where("off"), opt_in=False),
                         "version": Child("version", where("version"), opt_in=True),
                         "scheduler": Child("scheduler", where("scheduler"), opt_in=True,
                                            timeout=300)}
        self.alias = Alias(where("alias"))

    def close(self) -> None:
        for c in [*self.children.values(), self.alias]:
            c.stop()
        for c in self.children.values():
            c.err.close()
        for f in self.alias.files:
            f.close()
        shutil.rmtree(self.base, ignore_errors=True)


def start_early() -> None:
    if not _early:
        _early.append(Started())


def take() -> Started:
    """What the session started, or a fresh start."""
    return _early.pop() if _early else Started()


def start_route_early() -> None:
    if not _route:
        base = tempfile.mkdtemp(prefix="hicache_mp-plugin-route-")
        _route.append((Child("on", base, opt_in=True, timeout=300), base))


def take_route() -> tuple:
    """(the plugin route's Child, its directory): what the session started, or a fresh start."""
    if not _route:
        start_route_early()
    return _route.pop()


def stop_early() -> None:
    while _early:
        _early.pop().close()
    while _route:
        child, base = _route.pop()
        child.stop()
        child.err.close()
        shutil.rmtree(base, ignore_errors=True)
