"""Replacing a dead worker never blocks poll(), and "broken" is one terminal state.

- The poll() that notices a death launches the replacement and returns before
  it is ready (waiting for the new worker to map and pre-populate the whole
  pool would take seconds at production sizes); work goes to the ready
  workers meanwhile, and to the replacement once it is ready.
- A replacement that dies before it is ready is retried; only
  MAX_START_FAILURES in a row break the pool, after which every prefetch and
  backup raises BrokenPool, and in-flight pages still end (never hang).

Reaches inside: the engine's `_control` (a worker's READY_PID word and the
evictor's EVICTOR_PID word: whether a replacement has said it is ready yet,
which is the point of the test and no public call reports per process) and
`_evictor` (the evictor's child process, to kill it and see its replacement
alive: the public `worker_pids()` names the I/O workers only).
"""
import os
import signal
import time

import numpy as np
import pytest

from hicache_mp import BrokenPool
from workers.control import READY_PID
from workers.pool import MAX_START_FAILURES

from faultkit import backup, content, fingerprint, make, prefetch, wrong_pages

N = 12


def _allowed(e):
    return lambda k: {fingerprint(content(k, e.geometry.page_bytes))}


def _poll_until(e, check, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        e.poll()
        time.sleep(0.002)


def test_respawn_returns_before_the_new_worker_is_ready(store):
    keys = [f"k{i}" for i in range(N)]
    with make(store, pages=2 * N, workers=2) as e:
        assert backup(e, keys, range(N)).status == "ok"
        victim = e.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        _poll_until(e, lambda: e.metrics()["respawns"] == 1)
        new = e.worker_pids()[1]
        # The poll() that launched it has returned; a fresh interpreter cannot have
        # mapped the pool and said ready yet.
        assert new != victim and int(e._control.workers[1][READY_PID]) != new
        assert e.metrics()["workers_starting"] == 1
        op = e.prefetch(keys, range(N, 2 * N))
        assert (op.worker_of == 0).all()  # only the ready worker takes work meanwhile
        assert e.wait(op, 20) and op.status == "ok" and not wrong_pages(e, op, _allowed(e))
        _poll_until(e, lambda: e.metrics()["workers_starting"] == 0)
        assert int(e._control.workers[1][READY_PID]) == new
        again = prefetch(e, keys, range(N, 2 * N))
        assert set(again.worker_of.tolist()) == {0, 1}
        assert again.status == "ok" and not wrong_pages(e, again, _allowed(e))


def test_failed_replacements_break_the_pool_once_and_for_good(store):
    keys = [f"b{i}" for i in range(N)]
    with make(store, pages=2 * N, workers=2) as e:
        assert backup(e, keys, range(N)).status == "ok"
        os.kill(e.worker_pids()[1], signal.SIGKILL)
        # Kill each replacement before it can say ready.
        for attempt in range(MAX_START_FAILURES):
            _poll_until(e, lambda: e.metrics()["respawns"] == attempt + 1)
            os.kill(e.worker_pids()[1], signal.SIGKILL)
            assert e.metrics()["broken"] is None
            # Failed starts short of the limit are not broken: the engine takes work.
            assert prefetch(e, keys, range(N, 2 * N)).status == "ok"
        _poll_until(e, lambda: e.metrics()["broken"] is not None)
        assert "hicache_mp-worker-1" in e.metrics()["broken"]
        for call in (lambda: e.prefetch(keys, range(N, 2 * N)), lambda: e.backup(keys, range(N))):
            with pytest.raises(BrokenPool):
                call()
        # Terminal: nothing respawns any more, and the refusal leaves no slot held.
        respawns = e.metrics()["respawns"]
        for _ in range(30):
            e.poll()
            time.sleep(0.01)
        m = e.metrics()
        assert m["respawns"] == respawns and m["broken"] and m["pages_in_flight"] == 0, m


def test_a_dead_evictor_is_replaced_in_the_background(store):
    """The evictor starts through the same child helper: its replacement too is
    launched by one poll() and says ready later, and eviction goes on."""
    from workers.control import EVICTOR_PID
    with make(store, pages=2 * N, workers=1, storage_max_bytes=4 << 20) as e:
        old = int(e._control.words[EVICTOR_PID])
        assert old and old == e._evictor.child.pid
        os.kill(old, signal.SIGKILL)
        _poll_until(e, lambda: e.metrics()["evictor_respawns"] == 1)
        new = e._evictor.child.pid
        assert new != old and int(e._control.words[EVICTOR_PID]) != new  # not waited for
        _poll_until(e, lambda: int(e._control.words[EVICTOR_PID]) == new)
        assert e._evictor.alive()
        assert backup(e, [f"e{i}" for i in range(N)], range(N)).status == "ok"
