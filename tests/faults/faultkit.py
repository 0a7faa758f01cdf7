"""Tools the fault-injection tests share: deterministic page contents, raw slot
access, store inspection, catching a worker in the middle of its I/O, and
running code without root's file-permission override.

Torch-free on purpose: these helpers also run inside child processes (the
sharing test's second "node", the unprivileged children), where importing
torch would cost seconds per start.

Page bytes are handled in canonical order (what a page file holds), read from
and written to the host pool's shared mapping through `PageGeometry.page_runs`,
so a check never depends on the host layout.

Reaches inside: the engine's `_control` (the control block: the evictor's
pass count, a worker's heartbeat and read counters, to catch it inside a read
or know a pass ended), `_evictor` (its wake-up semaphore, to start a pass
now) and `_pool` (a worker's child handle, whose stop() is wrapped to let a
SIGSTOPped worker go once close() asks it to stop). Fault injection and
observing a worker mid-I/O: no public call may offer these. Workers are named
by index here; their pids come from the public `worker_pids()`.
"""
import ctypes
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from workers import naming
from workers.control import EVICT_PASSES
from workers.stores import open_store

TINY = dict(num_layers=3, num_kv_heads=2, head_dim=16, page_size=4)       # 1.5 KiB pages
MID = dict(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16)     # 64 KiB pages
BIG = dict(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16)     # 2 MiB pages: I/O lasts
HERE = os.path.dirname(os.path.abspath(__file__))


def geometry(layout: str = "page_first", **kw) -> PageGeometry:
    return PageGeometry(**{**TINY, **kw, "layout": layout})


def make(store: str, *, layout: str = "page_first", geo: dict | None = None, pages: int = 32,
         workers: int = 2, **cfg) -> PrefetchEngine:
    g = PageGeometry(**{**(geo or TINY), "layout": layout})
    return PrefetchEngine(EngineConfig(storage_dir=store, num_workers=workers,
                                       host_pool_pages=pages, **cfg), g)


# --- page contents ------------------------------------------------------------
def content(key: str, nbytes: int, writer: int = 0, version: int = 0) -> bytes:
    """Bytes only (writer, key, version) produces, so a read names its source."""
    seed = int.from_bytes(hashlib.sha256(f"{writer}|{key}|{version}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).bytes(nbytes)


def fingerprint(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def put(eng, slot: int, data: bytes) -> None:
    """Fill host slot `slot` with canonical-order `data`."""
    mv = memoryview(eng.host_pool.segment.map)
    at = 0
    for off, length in eng.geometry.page_runs(slot, eng.host_pool.num_pages):
        mv[off:off + length] = data[at:at + length]
        at += length


def get(eng, slot: int) -> bytes:
    """The canonical-order bytes of host slot `slot`."""
    mv = memoryview(eng.host_pool.segment.map)
    return b"".join(bytes(mv[o:o + n]) for o, n in eng.geometry.page_runs(slot, eng.host_pool.num_pages))


def poison(eng, slots) -> None:
    for s in slots:
        put(eng, s, b"\xa5" * eng.geometry.page_bytes)


def backup(eng, keys, slots, *, writer: int = 0, version: int = 0, timeout_s: float = 30):
    """Fill slots with content(key, writer, version), back them up, wait."""
    for k, s in zip(keys, slots):
        put(eng, s, content(k, eng.geometry.page_bytes, writer, version))
    op = eng.backup(keys, slots)
    assert eng.wait(op, timeout_s), f"backup hung: {op}"
    return op


def prefetch(eng, keys, slots, timeout_s: float = 30):
    poison(eng, slots)
    op = eng.prefetch(keys, slots)
    assert eng.wait(op, timeout_s), f"prefetch hung: {op}"
    return op


def wrong_pages(eng, op, allowed) -> list:
    """Positions whose status is ok but whose bytes are not in allowed(key) (a set of
    fingerprints). Must always be empty."""
    bad = []
    for pos in np.flatnonzero(op.page_status == 1).tolist():  # status.OK
        if fingerprint(get(eng, int(op.host_pages[pos]))) not in allowed(op.keys[pos]):
            bad.append(pos)
    return bad


# --- the store ------------------------------------------------------------------
def page_file(eng, key) -> str:
    return open_store(eng.config.storage_dir).path(naming.key_digest(key, eng.namespace))


def store_files(root: str) -> tuple[list, list]:
    """(page files, temp files) under the store's fan-out directories."""
    pages, tmps = [], []
    for d, _, files in os.walk(root):
        for f in files:
            if naming.TMP_MARK in f:
                tmps.append(os.path.join(d, f))
            elif f.endswith(naming.PAGE_SUFFIX):
                pages.append(os.path.join(d, f))
    return pages, tmps


def settle(check, timeout_s: float = 5.0, step: float = 0.05):
    """Poll `check` until it returns something truthy or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(step)


def workers_counted(eng, pages: int, timeout_s: float = 30.0) -> None:
    """Wait, without polling (nothing drained), until eng's workers have done
    `pages` pages in all: each counts a page before pushing its completion."""
    deadline = time.monotonic() + timeout_s
    while sum(eng.metrics()["worker_pages"]) < pages:
        assert time.monotonic() < deadline, eng.metrics()["worker_pages"]
        time.sleep(0.002)


def evictor_passes(eng) -> int:
    """Passes eng's evictor has ended (each counted after its removals are on the evict ring)."""
    return int(eng._control.words[EVICT_PASSES])


def wake_evictor(eng) -> None:
    """Post eng's evictor's wake-up: it starts a pass now, not at its interval."""
    eng._evictor.wake.post()


def a_pass_begun_now_ended(eng, timeout_s: float = 10.0) -> None:
    """Return once a pass of eng's evictor that began after this call has
    ended, its removals heard of. The first pass counted from now is the one
    in progress, if any, or the one a wake-up posted now starts; a second
    wake-up and pass cover the first case."""
    first = evictor_passes(eng)
    for n in (1, 2):
        wake_evictor(eng)
        assert settle(lambda: evictor_passes(eng) >= first + n, timeout_s, 0.002), \
            "the evictor ran no pass"
    eng.poll()


def capture_log() -> list[str]:
    """Messages the engine logs from now on; for children, where caplog is not."""
    import logging
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("hicache_mp").addHandler(Keep(logging.WARNING))
    return lines


# --- catching a worker in the middle of I/O -----------------------------------
def fill_dev_shm(path: str) -> int:
    """Fill /dev/shm to ENOSPC with one file at `path`; the bytes left free."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    size, chunk = 0, 1 << 20
    try:
        while chunk >= 4096:
            try:
                os.posix_fallocate(fd, size, chunk)
                size += chunk
            except OSError:
                chunk //= 2
    finally:
        os.close(fd)
    vfs = os.statvfs("/dev/shm")
    return vfs.f_bavail * vfs.f_frsize


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def open_files(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


def stop_during_io(pid: int, wanted, timeout_s: float = 10.0, run_s: float = 0.0002) -> str | None:
    """Step a stopped `pid` until it holds an open file `wanted(path)` accepts.

    The caller SIGSTOPs the worker before giving it work. Each step lets it run
    for `run_s` (SIGCONT, sleep, SIGSTOP) and looks at /proc/<pid>/fd.
    Returns the path with the process left stopped (the caller kills it), or
    None if it never caught the worker in the act.
    """
    def held():
        hit = [p for p in open_files(pid) if wanted(p)]
        return hit[0] if hit else None
    return stop_when(pid, held, timeout_s, run_s)


def catch_in_read(eng, victim: int, submit, steps, tries: int = 40):
    """Call `submit()` (a prefetch; returns its op) with worker `victim` (an
    index) stopped, and step the victim until it is inside one of its reads (its
    heartbeat set: a page I/O as the watchdog sees one). Returns the op with
    the victim left stopped, or None. A page-cache read of 2 MiB is short: a
    try often ends with all of the victim's reads done between two stops; it
    is then given up at once (the op let finish) and made again, with the
    next step length of `steps` (fresh-clone CI runs missed 4 and 8 tries of
    5 s each when only an open page file counted and a try ran to its end)."""
    from workers.control import READS_DONE, READS_SUBMITTED
    pid = eng.worker_pids()[victim]
    beat = eng._control.heartbeat[victim]
    row = eng._control.workers[victim]

    def caught():
        if beat.any():
            return "read"
        return "missed" if int(row[READS_DONE]) >= int(row[READS_SUBMITTED]) else None

    for attempt in range(tries):
        os.kill(pid, signal.SIGSTOP)
        op = submit()
        if stop_when(pid, caught, 5.0, steps[attempt % len(steps)]) == "read":
            return op
        os.kill(pid, signal.SIGCONT)
        assert eng.wait(op, 30) and op.status == "ok"
    return None


def stop_when(pid: int, check, timeout_s: float = 10.0, run_s: float = 0.0002):
    """Step a stopped `pid` (as stop_during_io) until `check()` returns
    something true while it is stopped; that, with `pid` left stopped, or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _wait_stopped(pid)
        hit = check()
        if hit:
            return hit
        os.kill(pid, signal.SIGCONT)
        time.sleep(run_s)
        os.kill(pid, signal.SIGSTOP)
    return None


def _wait_stopped(pid: int) -> None:
    while _state(pid) not in "Tt":
        time.sleep(0.0001)


def resume_when_told_to_stop(eng, worker: int) -> None:
    """SIGCONT the SIGSTOPped `worker` (eng's worker of that index) once eng's
    close() has told its workers to stop: its flush is over by then and what
    the worker held is left to be cancelled. The worker then exits at once,
    where close() would sit out STOP_GRACE_S (2 s) before its SIGKILL (a test
    of that bound lets it). Its stop word is set before close() waits on it."""
    child = eng._pool.workers[worker].child
    wait_for_exit = child.stop

    def stop(deadline):
        os.kill(child.pid, signal.SIGCONT)
        wait_for_exit(deadline)
    child.stop = stop


# --- running without root's permission override -----------------------------------
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER = 1, 2, 3
PR_CAPBSET_DROP = 24


def _drop_dac_caps() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_child(body: str, *args, unprivileged: bool = True, fsize_limit: int | None = None,
              timeout_s: float = 60) -> dict:
    """Run `body` (Python source that fills a dict `result`; `args` holds the
    arguments) in a fresh interpreter, and return `result`.

    unprivileged: the child keeps uid 0 but loses CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH and CAP_FOWNER from its bounding set before exec, so
    mode bits bind it (and the workers it spawns) like any ordinary user. A
    setuid child cannot run an engine here: the interpreter lives under /root
    (0700), so another uid could not start `python -m workers.worker`.
    fsize_limit: RLIMIT_FSIZE for the child and its workers (they inherit it).
    """
    if unprivileged and os.geteuid() != 0:
        import pytest
        pytest.skip("needs root to drop capabilities")

    def prepare():
        if fsize_limit is not None:
            import resource
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
        if unprivileged:
            _drop_dac_caps()

    script = ("import json, sys\nsys.path[:0] = [%r]\nargs = json.loads(sys.argv[1])\n"
              "result = {}\n%s\nprint('RESULT ' + json.dumps(result), flush=True)\n") % (HERE, body)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(list(args))],
                          preexec_fn=prepare, capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def as_other_user(fn, uid: int = 65534):
    """Fork, setuid(uid), run fn() (already-imported code only: no exec), return
    its JSON-able result. For checks that need a different user, not a different
    binary."""
    if os.geteuid() != 0:
        import pytest
        pytest.skip("needs root to switch users")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = json.dumps(fn()).encode()
            os.write(w, out)
        except BaseException as exc:  # report anything, then leave
            os.write(w, json.dumps({"error": repr(exc)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))
