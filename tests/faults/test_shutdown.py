"""close() flushes backups in flight (like Executor.shutdown(wait=True)), bounded
by a timeout; close(flush=False) cancels them; new work is refused meanwhile."""
import os
import signal
import time

import pytest

from hicache_mp import EngineClosed

from faultkit import BIG, content, get, make, put

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
    os.kill(e._pool.workers[1].pid, signal.SIGSTOP)  # its half of the backup cannot finish
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
    os.kill(e._pool.workers[1].pid, signal.SIGSTOP)
    op = e.backup(keys, range(N))
    t0 = time.monotonic()
    e.close(flush=False)
    assert time.monotonic() - t0 < 15
    assert op.done and op.status_counts().get("cancelled", 0) > 0, op.status_counts()
