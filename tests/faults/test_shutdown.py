"""close() flushes backups in flight (like Executor.shutdown(wait=True)), bounded
by a timeout, and says what it could not flush; close(flush=False) cancels
them; new work is refused meanwhile; a close() interrupted by another (a
signal handler's) finishes without either waiting for the other."""
import os
import signal
import threading
import time

import pytest

from hicache_mp import EngineClosed

from faultkit import BIG, content, get, make, put, resume_when_told_to_stop

N = 16


def _fill(e, keys, slots):
    for k, s in zip(keys, slots):
        put(e, s, content(k, e.geometry.page_bytes))


def test_leaving_the_with_block_right_after_backup_writes_every_page(store):
    keys = [f"f{i}" for i in range(N)]
    with make(store, geo=BIG, pages=2 * N, workers=2) as e:
        _fill(e, keys, range(N))
        op = e.backup(keys, range(N))
    assert op.done and op.status == "ok", op.status_counts()
    with make(store, geo=BIG, pages=2 * N, workers=2) as again:
        got = again.prefetch(keys, range(N))
        assert again.wait(got, 30) and got.status == "ok"
        assert all(get(again, i) == content(k, again.geometry.page_bytes)
                   for i, k in enumerate(keys))


def test_flush_is_bounded_and_flush_false_cancels(store):
    keys = [f"t{i}" for i in range(N)]
    e = make(store, geo=BIG, pages=2 * N, workers=2, worker_batch=1)
    _fill(e, keys, range(N))
    os.kill(e.worker_pids()[1], signal.SIGSTOP)  # its half of the backup cannot finish
    op = e.backup(keys, range(N))
    t0 = time.monotonic()
    e.close(timeout_s=1.0)
    took = time.monotonic() - t0
    assert took < 15, f"close() took {took:.1f}s with a 1 s flush limit"
    assert op.done and op.status_counts().get("cancelled", 0) > 0, op.status_counts()
    with pytest.raises(EngineClosed):
        e.backup(keys, range(N))


def test_flush_false_does_not_wait(store):
    keys = [f"n{i}" for i in range(N)]
    e = make(store, geo=BIG, pages=2 * N, workers=2, worker_batch=1)
    _fill(e, keys, range(N))
    os.kill(e.worker_pids()[1], signal.SIGSTOP)
    resume_when_told_to_stop(e, 1)  # the bound is the test above's
    op = e.backup(keys, range(N))
    t0 = time.monotonic()
    e.close(flush=False)
    assert time.monotonic() - t0 < 15
    assert op.done and op.status_counts().get("cancelled", 0) > 0, op.status_counts()


def test_a_bounded_flush_says_what_it_left(store, caplog):
    """A server stops within its flush limit and says why it could not flush:
    metrics()["close"] and one warning count the pages cancelled."""
    keys = [f"w{i}" for i in range(N)]
    e = make(store, geo=BIG, pages=2 * N, workers=2, worker_batch=1)
    _fill(e, keys, range(N))
    os.kill(e.worker_pids()[1], signal.SIGSTOP)
    resume_when_told_to_stop(e, 1)
    op = e.backup(keys, range(N))
    with caplog.at_level("WARNING", logger="hicache_mp"):
        e.close(timeout_s=0.5)
    report = e.metrics()["close"]
    cancelled = op.status_counts().get("cancelled", 0)
    assert cancelled and report["cancelled_pages"] == cancelled, (report, op.status_counts())
    assert report["backup_pages"] == N and "flush limit" in report["why"]
    assert any("cancelled" in r.getMessage() for r in caplog.records)


def test_a_close_says_how_long_the_shared_memory_took_to_give_back(store, caplog):
    """A big host pool's pages are freed by the kernel when the engine unmaps
    it (seconds for tens of GB): close() times that apart, says it, and does
    not count it as a slow close."""
    e = make(store, geo=BIG, pages=4 * N, workers=1)
    with caplog.at_level("INFO", logger="hicache_mp"):
        e.close()
    report = e.metrics()["close"]
    assert 0 < report["release_s"] <= report["close_s"], report
    lines = [r for r in caplog.records if "close() took" in r.getMessage()]
    assert len(lines) == 1 and "shared memory released in" in lines[0].getMessage()
    assert lines[0].levelname == "INFO"   # nothing was cancelled, nothing slow


def test_a_close_that_a_signal_handler_interrupts_with_another_close(store):
    """SIGTERM twice: the handler's close() runs while this thread's close()
    waits for a backup a stopped worker holds. Neither waits for the other;
    the nested one flushes (the worker goes on) and releases everything."""
    keys = [f"r{i}" for i in range(N)]
    e = make(store, geo=BIG, pages=2 * N, workers=2, worker_batch=1)
    _fill(e, keys, range(N))
    stopped = e.worker_pids()[1]
    os.kill(stopped, signal.SIGSTOP)
    op = e.backup(keys, range(N))
    nested = []

    def on_signal(*_):
        os.kill(stopped, signal.SIGCONT)
        e.close()
        nested.append(e.closed)

    old = signal.signal(signal.SIGUSR1, on_signal)
    try:
        main = threading.main_thread().ident
        threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGUSR1)).start()
        t0 = time.monotonic()
        e.close(timeout_s=20)
        took = time.monotonic() - t0
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert nested == [True] and took < 5, (nested, took)
    assert op.status == "ok", op.status_counts()
    with pytest.raises(EngineClosed):
        e.poll()
