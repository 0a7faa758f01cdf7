"""Blocking waits survive signals (issue 17, item 2).

A server installs Python signal handlers; a signal that lands while a thread
sleeps in a wait must not end the wait early or raise (posix_ipc's SignalError
escaped before): the sleep resumes within its deadline.
"""
import os
import signal
import threading
import time

from faultkit import backup, content, fingerprint, make, wrong_pages


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
