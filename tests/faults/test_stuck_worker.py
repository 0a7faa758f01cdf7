"""A worker stuck in a page I/O (SIGSTOP stands for a hung network filesystem).

- The watchdog: past `stall_timeout_s` the worker is killed, every page it
  held ends worker_died at once, metrics() counts it, a replacement takes
  over and the next op works.
- The fence: a slot whose page was reported failed is refused to new ops
  until the stuck worker is reaped, its bytes never change after the
  failure was reported, and its op is done (its slots free) only then.
- Reads first does not turn into "backups never": a read stuck at one worker
  does not hold back the writes of the others.
"""
import os
import signal
import time

import numpy as np
import pytest

from workers import status as st

from faultkit import BIG, backup, content, fingerprint, get, make, poison, prefetch, put, \
    catch_in_read, wrong_pages

N = 16


def _catch_in_read(e, index, keys, slots):
    """Prefetch `keys` with worker `index` frozen inside one of its reads; returns the op."""
    def submit():
        poison(e, slots)
        return e.prefetch(keys, slots)
    op = catch_in_read(e, index, submit, steps=(0.0, 0.0001, 0.0002, 0.0005))
    if op is None:
        pytest.fail("never caught the worker inside a read")
    return op


def test_stuck_worker_is_failed_fenced_and_replaced(store):
    keys = [f"s{i}" for i in range(N)]
    slots = list(range(N, 2 * N))
    with make(store, geo=BIG, pages=2 * N, workers=2, worker_batch=1) as e:
        assert backup(e, keys, range(N)).status == "ok"
        victim = e.worker_pids()[1]
        op = _catch_in_read(e, 1, keys, slots)
        # Stepping the worker through reads (above) makes a healthy read last
        # seconds of wall time: the stall limit is lowered once it is caught.
        e.config.stall_timeout_s = 1.0
        # Bounded: the stall limit plus a health check, not the stuck read.
        deadline = time.monotonic() + 20
        while not (op.page_status == st.WORKER_DIED).any():
            assert time.monotonic() < deadline, f"op hung behind a stuck worker: {op}"
            e.poll()
            time.sleep(0.01)
        # Killed in this health check, reaped in a later one at the earliest: its
        # pages' status is final now, but their slots are fenced and the op is
        # not done (op.done is when its slots may be reused).
        assert os.path.exists(f"/proc/{victim}")
        failed = [int(op.host_pages[p]) for p in np.flatnonzero(op.page_status == st.WORKER_DIED)]
        frozen = {s: get(e, s) for s in failed}
        assert not op.done and e.metrics()["fenced_pages"] == len(failed)
        with pytest.raises(ValueError, match="in flight"):
            e.prefetch([keys[0]], [failed[0]])
        assert e.wait(op, 20), f"op not done once the stuck worker was gone: {op}"
        assert not os.path.exists(f"/proc/{victim}"), "op done before the worker was reaped"
        counts = op.status_counts()
        assert counts.get("worker_died", 0) == len(failed) and op.status in ("partial", "failed")
        assert not wrong_pages(e, op, lambda k: {fingerprint(content(k, e.geometry.page_bytes))})
        m = e.metrics()
        assert m["stuck_workers"] == 1 and m["stalled_pages"] == len(failed), m
        assert m["fenced_pages"] == 0
        assert all(get(e, s) == frozen[s] for s in failed), "a failed page's slot changed later"
        # At op.done its slots are free, the failed ones too.
        reuse = e.prefetch([keys[0]], [failed[0]])
        assert e.wait(reuse, 10) and reuse.status == "ok"
        # Replaced, and the next op works on every page.
        assert e.worker_pids()[1] != victim
        again = prefetch(e, keys, slots)
        assert again.status == "ok" and not wrong_pages(
            e, again, lambda k: {fingerprint(content(k, e.geometry.page_bytes))})


def test_a_stuck_read_does_not_hold_back_other_workers_backups(store):
    """Worker 1 frozen in a read (no watchdog within the test); the backups that
    go to worker 0 all land. Were the stuck read counted as outstanding, each
    would wait WRITE_DEFER_MAX_S (0.5 s): 12 s for 24 pages."""
    keys = [f"r{i}" for i in range(N)]
    with make(store, geo=BIG, pages=4 * N + 48, workers=2, worker_batch=1) as e:
        assert backup(e, keys, range(N)).status == "ok"
        victim = e.worker_pids()[1]
        read = _catch_in_read(e, 1, keys, list(range(N, 2 * N)))
        pb = e.geometry.page_bytes
        wkeys = [f"w{i}" for i in range(48)]
        wslots = list(range(2 * N, 2 * N + 48))
        for k, s in zip(wkeys, wslots):
            put(e, s, content(k, pb))
        op = e.backup(wkeys, wslots)
        mine = op.worker_of == 0
        assert mine.sum() == 24
        deadline = time.monotonic() + 8  # 12 s if each page waited 0.5 s
        while (op.page_status[mine] == st.PENDING).any():
            assert time.monotonic() < deadline, \
                f"backups throttled by a stuck read: {(op.page_status[mine] != st.PENDING).sum()} of 24"
            e.poll()
            time.sleep(0.005)
        assert (op.page_status[mine] == st.OK).all()
        os.kill(victim, signal.SIGKILL)
        assert e.wait(read, 10) and e.wait(op, 10)


def test_worker_stuck_outside_a_page_io_is_caught_by_its_queue(store):
    """Stopped while idle: no I/O is running, but the pages queued for it do not
    move; past the stall limit it is treated as stuck all the same."""
    keys = [f"q{i}" for i in range(N)]
    with make(store, pages=2 * N, workers=2, stall_timeout_s=1.0) as e:
        assert backup(e, keys, range(N)).status == "ok"
        victim = e.worker_pids()[1]
        os.kill(victim, signal.SIGSTOP)
        op = e.prefetch(keys, range(N, 2 * N))
        assert e.wait(op, 20), f"op hung behind a stopped worker: {op}"
        assert op.status == "partial" and op.status_counts()["worker_died"] == N // 2
        assert e.metrics()["stuck_workers"] == 1
        assert e.worker_pids()[1] != victim
        deadline = time.monotonic() + 10
        while e.metrics()["workers_starting"] or e.metrics()["fenced_pages"]:
            assert time.monotonic() < deadline
            e.poll()
            time.sleep(0.01)
        again = prefetch(e, keys, range(N, 2 * N))
        assert again.status == "ok" and not wrong_pages(
            e, again, lambda k: {fingerprint(content(k, e.geometry.page_bytes))})
