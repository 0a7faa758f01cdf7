"""Blocking waits survive signals (issue 17, item 2), and a handler may close the engine (issue 23).

A server installs Python signal handlers; a signal that lands while a thread
sleeps in a wait must not end the wait early or raise (posix_ipc's SignalError
escaped before): the sleep resumes within its deadline. A handler that closes
the engine while its thread is inside a wait or a poll ends that call, and
every later one, with EngineClosed (test_sigterm_close: the same from another
process, many times).
"""
import os
import signal
import threading
import time

import pytest

from faultkit import backup, content, fingerprint, make, prefetch, put, wrong_pages


def test_waits_survive_a_storm_of_signals(store):
    hits = []
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    try:
        with make(store, pages=16, workers=1) as e:
            keys = [f"k{i}" for i in range(4)]
            backup(e, keys, range(4))
            worker = e.worker_pids()[0]
            errors, timed, untimed = [], [], []

            os.kill(worker, signal.SIGSTOP)  # nothing completes while the signals fly
            try:
                stuck = e.prefetch(keys, range(4, 8))

                def timed_wait():
                    try:
                        t0 = time.monotonic()
                        timed.append((e.wait(stuck, 1.0), time.monotonic() - t0))
                    except BaseException as exc:
                        errors.append(repr(exc))

                def untimed_wait():
                    try:
                        untimed.append(e.wait(stuck))
                    except BaseException as exc:
                        errors.append(repr(exc))

                threads = [threading.Thread(target=timed_wait) for _ in range(3)]
                threads.append(threading.Thread(target=untimed_wait))
                for t in threads:
                    t.start()
                end = time.monotonic() + 1.5
                while time.monotonic() < end:
                    for t in threads:
                        if t.is_alive():
                            signal.pthread_kill(t.ident, signal.SIGUSR1)
                    os.kill(os.getpid(), signal.SIGUSR1)
                    time.sleep(0.002)
            finally:
                os.kill(worker, signal.SIGCONT)
            for t in threads:
                t.join(30)
            assert not errors, errors[:3]
            assert len(timed) == 3 and all(not done and 1.0 <= s < 5.0 for done, s in timed), timed
            assert untimed == [True] and stuck.status == "ok"
            assert not wrong_pages(e, stuck, lambda k: {fingerprint(content(k, e.geometry.page_bytes))})
            assert len(hits) > 100  # the handler really ran, many times
    finally:
        signal.signal(signal.SIGUSR1, old)


# --- close() from a signal handler (issue 23, bug 1) ----------------------------------
def _signal_main_thread_in(delay_s: float) -> None:
    """SIGUSR1 to this (the main) thread after `delay_s`, so its sleep ends
    in EINTR and the handler runs on it, inside whatever engine call it is in."""
    main = threading.main_thread().ident
    threading.Timer(delay_s, signal.pthread_kill, (main, signal.SIGUSR1)).start()


def test_close_in_a_handler_that_interrupted_a_wait_flushes_and_ends_the_wait(store):
    """The main thread sleeps in wait() on a backup its stopped worker holds;
    the handler lets the worker go and closes: close() must not wait for the
    very thread it runs on (it took 5 s, or hung), its flush writes the
    backup, and the interrupted wait() ends with EngineClosed, not with the
    closed semaphore's or control block's errors."""
    from hicache_mp import EngineClosed
    keys = [f"h{i}" for i in range(4)]
    with make(store, pages=16, workers=1) as e:
        g = e.geometry
        for i, k in enumerate(keys):
            put(e, i, content(k, g.page_bytes))
        worker = e.worker_pids()[0]
        os.kill(worker, signal.SIGSTOP)
        took = []

        def on_signal(*_):
            os.kill(worker, signal.SIGCONT)
            t0 = time.monotonic()
            e.close()
            took.append(time.monotonic() - t0)

        old = signal.signal(signal.SIGUSR1, on_signal)
        try:
            op = e.backup(keys, range(4))
            _signal_main_thread_in(0.3)
            with pytest.raises(EngineClosed):
                e.wait(op, 20)
        finally:
            signal.signal(signal.SIGUSR1, old)
            if not e.closed:
                os.kill(worker, signal.SIGCONT)
        assert took and took[0] < 1.0, f"close() in the handler took {took}"
        assert op.status == "ok", op.status_counts()  # the flush wrote it
        assert e.metrics()["close"]["flushed_pages"] == 4
    with make(store, pages=16, workers=1) as again:
        got = prefetch(again, keys, range(4))
        assert got.status == "ok"
        assert not wrong_pages(again, got, lambda k: {fingerprint(content(k, g.page_bytes))})


def test_after_a_handler_closed_it_every_call_says_engine_closed(store):
    """A handler that only closes, while the loop spins on poll(): the loop's
    poll() and every later call, host-pool access too, raise EngineClosed;
    cancel() has nothing left to do and metrics() still answers."""
    from hicache_mp import EngineClosed
    e = make(store, pages=16, workers=2)
    backup(e, ["a", "b"], [0, 1])
    old = signal.signal(signal.SIGUSR1, lambda *_: e.close())
    try:
        op = e.prefetch(["a", "b"], [2, 3])
        _signal_main_thread_in(0.2)
        deadline = time.monotonic() + 10
        with pytest.raises(EngineClosed):
            while time.monotonic() < deadline:
                e.poll()
    finally:
        signal.signal(signal.SIGUSR1, old)
    calls = [lambda: e.wait(op, 1), e.poll, lambda: e.prefetch(["a"], [4]),
             lambda: e.backup(["c"], [5]), lambda: e.exists(["a", "zz"]),
             lambda: e.ask(["zz"]), lambda: e.host_pool.page_view(0),
             lambda: e.host_pool.segment, lambda: put(e, 0, bytes(e.geometry.page_bytes))]
    for call in calls:
        with pytest.raises(EngineClosed):
            call()
    e.cancel(op)
    assert op.done and e.metrics()["close"] is not None
