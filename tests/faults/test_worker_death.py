"""A worker SIGKILLed with pages queued, mid-read and mid-write: the op ends
partial or failed in bounded time, the worker is replaced, the next op works,
a landed page is never wrong and a temp file never becomes a page.

Big (2 MiB) pages so each read or write lasts long enough to be caught: the
test freezes the victim exactly while it holds the page or temp file open.
"""
import os
import signal
import time

import pytest

from workers import naming

from faultkit import BIG, backup, catch_in_read, content, fingerprint, get, make, prefetch, \
    put, settle, stop_during_io, store_files, wrong_pages

N = 24
DEADLINE_S = 10  # "bounded time": generous for a 2-core CI box, far from a hang


def _allowed(eng):
    return lambda key: {fingerprint(content(key, eng.geometry.page_bytes))}


def _wait_bounded(eng, op):
    t0 = time.monotonic()
    assert eng.wait(op, DEADLINE_S), f"op hung after a worker died: {op}"
    return time.monotonic() - t0


def test_worker_killed_with_pages_queued(store):
    keys = [f"q{i}" for i in range(N)]
    with make(store, pages=2 * N, workers=2, worker_batch=1) as e:
        assert backup(e, keys, range(N)).status == "ok"
        victim = e.worker_pids()[1]  # page 0 goes to worker 0, so some pages lead
        os.kill(victim, signal.SIGSTOP)  # freeze it with its share still queued
        op = e.prefetch(keys, range(N, 2 * N))
        os.kill(victim, signal.SIGKILL)
        _wait_bounded(e, op)
        assert op.status == "partial" and op.status_counts().get("worker_died", 0) > 0
        assert not wrong_pages(e, op, _allowed(e))
        assert e.metrics()["respawns"] == 1 and e.worker_pids()[1] != victim
        again = prefetch(e, keys, range(N, 2 * N))
        assert again.status == "ok" and not wrong_pages(e, again, _allowed(e))


# The two tests below also run at io_depth 2: the lanes (threads) die with the
# worker mid-I/O, and the outcome must be the same.
# Lanes pass the GIL between syscalls, so a step must be long enough for a
# thread handoff or the worker makes no progress between stops.
def _step_s(depth):
    return 0.0002 if depth == 1 else 0.001


@pytest.mark.parametrize("depth", [1, 2])
def test_worker_killed_mid_read(store, depth):
    keys = [f"r{i}" for i in range(N)]
    with make(store, geo=BIG, pages=2 * N, workers=2, worker_batch=1, io_depth=depth) as e:
        assert backup(e, keys, range(N)).status == "ok"
        victim = e.worker_pids()[1]
        # Reads are quick (2 MiB from the page cache): a try that misses them is
        # let finish and made again (faultkit.catch_in_read; reads can be
        # repeated; writes, below, are slow enough to be caught in one pass).
        op = catch_in_read(e, 1, lambda: e.prefetch(keys, range(N, 2 * N)),
                           steps=tuple(_step_s(depth) * k for k in (0.5, 1, 2, 4)))
        os.kill(victim, signal.SIGKILL)
        assert op is not None, "never caught the worker inside a read"
        _wait_bounded(e, op)
        assert op.status in ("partial", "failed")
        assert op.status_counts().get("worker_died", 0) > 0
        assert not wrong_pages(e, op, _allowed(e))  # half-read slot never reported ok
        assert e.metrics()["respawns"] == 1
        again = prefetch(e, keys, range(N, 2 * N))
        assert again.status == "ok" and not wrong_pages(e, again, _allowed(e))


def _kill_inside_a_write(e, keys, depth):
    """Back `keys` up from slots 0.. and SIGKILL worker 1 while it holds a temp
    file open; (the op, ended in bounded time; the temp file's path)."""
    pb = e.geometry.page_bytes
    for i, k in enumerate(keys):
        put(e, i, content(k, pb))
    victim = e.worker_pids()[1]
    os.kill(victim, signal.SIGSTOP)
    op = e.backup(keys, range(len(keys)))
    tmp = stop_during_io(victim, lambda p: naming.TMP_MARK in p, run_s=_step_s(depth))
    os.kill(victim, signal.SIGKILL)
    assert tmp, "never caught the worker inside a write"
    _wait_bounded(e, op)
    return op, tmp


@pytest.mark.parametrize("depth", [1, 2])
def test_worker_killed_mid_write(store, depth):
    keys = [f"w{i}" for i in range(N)]
    with make(store, geo=BIG, pages=2 * N, workers=2, worker_batch=1, io_depth=depth) as e:
        pb = e.geometry.page_bytes
        op, tmp = _kill_inside_a_write(e, keys, depth)
        assert op.status in ("partial", "failed")
        assert op.status_counts().get("worker_died", 0) > 0
        # The half-written temp file is no page: not indexed, not at the page's path.
        half = tmp[:tmp.index(naming.TMP_MARK)]
        assert naming.digest_from_name(os.path.basename(tmp)) is None
        assert not os.path.exists(half)
        assert e.exists(keys) <= op.completed_pages
        # ...and the running engine removes it (a rescan reaps a dead writer's temp files).
        assert settle(lambda: not store_files(store)[1]), f"temp files stayed: {store_files(store)[1]}"
        assert e.metrics()["respawns"] == 1
        # Every page file present is whole; every page reported written reads back.
        got = prefetch(e, keys, range(N, 2 * N))
        assert not wrong_pages(e, got, _allowed(e))
        written = [i for i, s in enumerate(op.page_status.tolist()) if s == 1]
        assert all(got.page_status[i] == 1 for i in written)
        # The next backup works, and completes what the dead worker dropped.
        assert backup(e, keys, range(N)).status == "ok"
        assert prefetch(e, keys, range(N, 2 * N)).status == "ok"
        assert get(e, N) == content(keys[0], pb)


def test_a_write_killed_mid_way_stops_counting_towards_the_store_limit(store):
    """With a byte limit, a write reserves its page before it starts (the
    evictor counts the reservation as store bytes). A worker killed inside a
    write never clears its reservation: once its replacement runs, the
    engine's estimate of the store must come back to the page files on disk,
    not stay a page over for as long as the replacement writes nothing."""
    keys = [f"l{i}" for i in range(N)]
    with make(store, geo=BIG, pages=2 * N, workers=2, worker_batch=1,
              storage_max_bytes=1 << 40, eviction_interval_s=0.1) as e:
        _kill_inside_a_write(e, keys, 1)
        assert settle(lambda: not store_files(store)[1]), "the dead writer's temp file stayed"
        assert settle(lambda: e.metrics()["respawns"] == 1)

        def on_disk():
            return sum(os.path.getsize(p) for p in store_files(store)[0])
        assert settle(lambda: e.metrics()["store_bytes_estimate"] == on_disk(), timeout_s=10), \
            (e.metrics()["store_bytes_estimate"], on_disk())
