"""A signal handler's exception reaches the caller of a wait (decision 99).

posix_ipc's Semaphore.acquire(), interrupted by a signal, runs the Python
handler itself and replaces whatever it raised (but KeyboardInterrupt) by
SignalError, which the wait took for EINTR and resumed: a server whose SIGTERM
handler calls sys.exit() while its main thread sleeps in engine.wait() kept
running until SIGKILL. The sleep is libc's now (shm/wake.py), so the handler
runs in Python after the call returns and its exception propagates.

The engine cases run a real child server (signal_wait_child.py: a real
engine, a real worker held stopped, a real store) and check what a user would
notice: the exit status, how soon it stopped, and that nothing is left in
/dev/shm and no worker runs. The WakeSemaphore cases run here, on the main
thread.
"""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import leftovers
from shm.names import list_ours
from shm.wake import WakeSemaphore
from shm import new_owner_tag

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "signal_wait_child.py")
PROMPT_S = 2.0   # a stop "promptly": the child's wait is 6 s, its close well under 1 s
IN_WAIT = "shm/wake.py:wait"


# --- a child server -------------------------------------------------------------
def _reader(pipe, out: queue.Queue) -> None:
    for line in pipe:
        kind, _, rest = line.partition(" ")
        try:
            out.put((kind, json.loads(rest)))
        except ValueError:
            out.put(("NOISE", {"line": line}))
    out.put(("EOF", {}))


def _next(lines: queue.Queue, timeout_s: float):
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return None, None


def _serve(store: str, mode: str, signum: int, sends: int = 1, every_s: float = 0.1) -> dict:
    """Start a child server in `mode`, send it `signum` `sends` times once it
    waits, and collect what it said, its exit status, the time from the first
    signal to its exit, and what it left behind."""
    proc = subprocess.Popen([sys.executable, CHILD, mode, store], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    out = {"said": {}, "rc": None, "stop_s": None}
    workers, segments = [], []
    try:
        kind, ready = _next(lines, 60)
        assert kind == "READY", f"the child never said READY ({kind}): {proc.stderr.read()[-3000:]}"
        workers, segments = ready["workers"], ready["segments"]
        assert segments, "the child's engine listed no segment of its own"
        time.sleep(0.3)  # well inside its wait on the stalled prefetch
        t_sig = time.monotonic()
        for i in range(sends):
            if i:
                time.sleep(every_s)
            proc.send_signal(signum)
        try:
            out["rc"] = proc.wait(15)
            out["stop_s"] = time.monotonic() - t_sig
        except subprocess.TimeoutExpired:
            pass
        while True:
            kind, body = _next(lines, 10)
            if kind in (None, "EOF"):
                break
            out["said"].setdefault(kind, []).append(body)
    finally:
        for w in workers:  # a stopped worker of a dead child never notices its parent went
            try:
                os.kill(w, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out["stderr"] = proc.stderr.read()
    proc.stderr.close()
    out["shm_left"], out["procs_left"] = leftovers(proc.pid, workers, segments)
    return out


def _clean(out: dict) -> None:
    assert not out["shm_left"], f"left in /dev/shm: {out['shm_left']}"
    assert not out["procs_left"], f"workers still running: {out['procs_left']}"
    assert "Traceback" not in out["stderr"] or out["rc"] == 3, out["stderr"][-3000:]


def test_sys_exit_in_a_sigterm_handler_ends_a_wait(store):
    """The handler's SystemExit(3) ends engine.wait() at once; `with` closes
    the engine on the way out, so nothing is left."""
    out = _serve(store, "exit", signal.SIGTERM)
    landed = [b["where"] for b in out["said"].get("LANDED", [])]
    assert landed == [IN_WAIT], f"the SIGTERM did not land in the wait's sleep: {out}"
    assert "WAITED" not in out["said"], f"the handler's SystemExit was lost: {out['said']}"
    assert out["rc"] == 3, out
    assert out["stop_s"] < PROMPT_S, f"stopped {out['stop_s']:.2f}s after SIGTERM"
    _clean(out)


def test_sigint_gives_keyboard_interrupt_to_the_caller_of_wait(store):
    """KeyboardInterrupt reaches the caller; the engine stays consistent (the
    prefetch it waited on completes, with the right bytes) and closes."""
    out = _serve(store, "sigint", signal.SIGINT)
    kbi = out["said"].get("KBI")
    assert kbi and kbi[0]["where"] == IN_WAIT and kbi[0]["seconds"] < 0.3 + PROMPT_S, out
    assert out["said"].get("AFTER") == [{"done": True, "status": "ok", "right": True}], out
    assert out["rc"] == 4 and out["stop_s"] < PROMPT_S, out
    _clean(out)


def test_a_handler_that_returns_leaves_the_wait_to_its_own_end(store):
    """Five SIGTERMs to a handler that returns: the wait ends at its own
    timeout (1.5 s), not early and not restarted; then the prefetch completes."""
    out = _serve(store, "return", signal.SIGTERM, sends=5)
    waited = out["said"].get("WAITED")
    assert waited, out
    w = waited[0]
    assert w["done"] is False and 1.5 <= w["seconds"] < 2.0, w
    assert len(w["hits"]) == 5 and IN_WAIT in w["hits"], w
    assert out["said"].get("AFTER") == [{"done": True, "status": "ok", "right": True}], out
    assert out["rc"] == 0, out
    _clean(out)


# --- the semaphore itself, on this (the main) thread ----------------------------------
class Boom(Exception):
    pass


def _signal_me_after(delay_s: float, signum: int = signal.SIGUSR1) -> threading.Timer:
    t = threading.Timer(delay_s, signal.pthread_kill, (threading.main_thread().ident, signum))
    t.start()
    return t


@pytest.fixture
def sem():
    s = WakeSemaphore(new_owner_tag() + ".sigtest", create=True)
    yield s
    s.close()


def test_a_handlers_exception_ends_a_semaphore_wait(sem):
    def boom(*_):
        raise Boom()
    old = signal.signal(signal.SIGUSR1, boom)
    try:
        _signal_me_after(0.2)
        t0 = time.monotonic()
        with pytest.raises(Boom):
            sem.wait(3.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        signal.signal(signal.SIGUSR1, old)
    # nothing was taken or left inside: a post still wakes the next wait, and close() works
    sem.post()
    assert sem.wait(1.0) is True
    assert sem.wait(0) is False
    sem.close()
    assert sem.name not in [n.removeprefix("sem.") for n in list_ours()]


def test_a_handler_that_returns_leaves_a_semaphore_wait_to_its_deadline(sem):
    hits = []
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    try:
        timers = [_signal_me_after(d) for d in (0.2, 0.4, 0.6)]
        t0 = time.monotonic()
        assert sem.wait(1.0) is False
        took = time.monotonic() - t0
        for t in timers:
            t.join()
        assert len(hits) == 3 and 1.0 <= took < 1.3, (hits, took)
        t0 = time.monotonic()  # before the timer starts: the post is 0.5 s after t0 at the earliest
        _signal_me_after(0.2)
        threading.Timer(0.5, sem.post).start()
        assert sem.wait(5.0) is True  # a post still ends a wait a signal interrupted
        assert 0.5 <= time.monotonic() - t0 < 1.5 and len(hits) == 4
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_keyboard_interrupt_ends_a_semaphore_wait(sem):
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _signal_me_after(0.2, signal.SIGINT)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            sem.wait(3.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        signal.signal(signal.SIGINT, old)
