"""The write path under load: reads go before queued writes, writes are never
starved, and a backup over its budget is dropped at once with a status.

Ordering is observed, not timed: a worker is stopped (SIGSTOP) while both its
rings fill, then let go; `Op.landed_seq` gives the order in which it finished
pages (one worker's completions arrive in the order it did them).
"""
import time

import numpy as np

from faultkit import MID, backup, capture_log, content, fingerprint, make, prefetch, put, \
    wrong_pages
from storagekit import cont, stop_workers


def _allowed(e):
    return lambda k: {fingerprint(content(k, e.geometry.page_bytes))}


def _fill(e, keys, slots):
    for k, s in zip(keys, slots):
        put(e, s, content(k, e.geometry.page_bytes))


def test_reads_go_before_writes_queued_ahead_of_them(store):
    with make(store, geo=MID, pages=32, workers=1) as e:
        old = [f"old-{i}" for i in range(4)]
        backup(e, old, range(4))
        new = [f"new-{i}" for i in range(12)]
        _fill(e, new, range(4, 16))
        pids = stop_workers(e)
        try:
            wop = e.backup(new, range(4, 16))     # queued first
            rop = e.prefetch(old, range(16, 20))  # queued after every write
        finally:
            cont(pids)
        assert e.wait(wop, 30) and e.wait(rop, 30)
        assert rop.status == "ok" and wop.status == "ok"
        assert not wrong_pages(e, rop, _allowed(e))
        # Every read finished before the first write.
        assert rop.landed_seq.max() < wop.landed_seq.min(), (rop.landed_seq, wop.landed_seq)


def test_writes_are_not_starved_by_a_stream_of_reads(store):
    with make(store, geo=MID, pages=64, workers=1, reads_per_write=3) as e:
        old = [f"old-{i}" for i in range(24)]
        backup(e, old, range(24))
        new = [f"new-{i}" for i in range(4)]
        _fill(e, new, range(24, 28))
        pids = stop_workers(e)
        try:
            rop = e.prefetch(old, range(32, 56))
            wop = e.backup(new, range(24, 28))
        finally:
            cont(pids)
        assert e.wait(wop, 30) and e.wait(rop, 30)
        assert rop.status == "ok" and wop.status == "ok"
        # One write after every 3 reads: all 4 writes done before the 16th read.
        order = np.sort(rop.landed_seq)
        assert wop.landed_seq.max() < order[15], (rop.landed_seq, wop.landed_seq)


def test_backup_over_budget_is_dropped_at_once_and_never_stalls(store):
    log = capture_log()
    with make(store, geo=MID, pages=32, workers=2, backup_budget_pages=6) as e:
        keys = [f"b-{i}" for i in range(20)]
        _fill(e, keys, range(20))
        pids = stop_workers(e)   # storage is "stuck": nothing the workers hold finishes
        try:
            t0 = time.monotonic()
            first = e.backup(keys[:4], range(4))          # fits: 4 of 6
            second = e.backup(keys[4:8], range(4, 8))     # 2 fit, 2 dropped (the tail)
            third = e.backup(keys[8:20], range(8, 20))    # none fit
            e.poll()
            took = time.monotonic() - t0
            assert took < 1.0, f"backup() stalled for {took:.2f} s"
            assert third.done and third.status == "failed"
            assert third.status_counts() == {"dropped": 12}
            assert not first.done and not second.done
            assert second.page_status.tolist()[2:] == [13, 13]  # status.DROPPED
            m = e.metrics()
            assert m["write_status"]["dropped"] == 14 and m["backup_pages_held"] == 6
            # The dropped pages' host slots are free again at once (a slot still held
            # by an op in flight would raise ValueError here).
            e.prefetch(["nothing"], [10])
        finally:
            cont(pids)
        assert e.wait(first, 30) and e.wait(second, 30)
        assert first.status == "ok" and second.status == "partial"
        assert second.completed_pages == 2
        assert e.exists(keys) == 6  # the leading pages were written, the rest were not
        assert e.metrics()["backup_pages_held"] == 0
        assert backup(e, keys[8:14], range(8, 14)).status == "ok"  # room again
    dropped = [line for line in log if "dropped" in line]
    assert len(dropped) == 1 and "backup_budget_pages=6" in dropped[0], dropped
