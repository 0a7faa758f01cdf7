"""The write path under load: reads go before queued writes, writes take at
most `write_share` of a worker's I/O time while reads wait and are never
starved, and a backup over its budget is dropped at once with a status.

Ordering is observed, not timed: a worker is stopped (SIGSTOP) while both its
rings fill, then let go; `Op.landed_seq` gives the order in which it finished
pages (one worker's completions arrive in the order it did them).

Reaches inside: the engine's `_control` (worker 0's heartbeat: the read is
queued only once the worker is inside its write, which no public call
reports).
"""
import os
import time

import numpy as np
import pytest

from workers import naming

from faultkit import BIG, MID, backup, capture_log, content, fingerprint, make, open_files, \
    page_file, prefetch, put, stop_when, store_files, wrong_pages
from storagekit import cont, drop_cache, stop_workers


def _allowed(e):
    return lambda k: {fingerprint(content(k, e.geometry.page_bytes))}


def _fill(e, keys, slots):
    for k, s in zip(keys, slots):
        put(e, s, content(k, e.geometry.page_bytes))


def test_reads_go_before_writes_queued_ahead_of_them(store):
    # write_share 0.01: four reads cannot earn a write's worth of credit (the
    # default 0.1 could, were the box slow enough to make a cached read ~3 ms).
    with make(store, geo=MID, pages=32, workers=1, write_share=0.01) as e:
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
        # Every read finished before the first write.
        _reads_landed_first(e, rop, wop)


def _reads_landed_first(e, rop, wop) -> None:
    """Both ops end ok, the reads' bytes are right, and every read landed
    before the first write."""
    assert e.wait(wop, 30) and e.wait(rop, 30)
    assert rop.status == "ok" and wop.status == "ok"
    assert not wrong_pages(e, rop, _allowed(e))
    assert rop.landed_seq.max() < wop.landed_seq.min(), (rop.landed_seq, wop.landed_seq)


def _queued_reads_and_writes(e, nreads: int, nwrites: int, *, cold: bool = False):
    """One stopped worker; `nreads` pages to prefetch queued (cached, or with
    `cold` out of the page cache: read from the disk), then `nwrites` pages to
    back up; let go, both done. Returns (read op, write op)."""
    old = [f"old-{i}" for i in range(nreads)]
    backup(e, old, range(nreads))
    if cold:
        os.sync()  # written back first: the kernel drops only clean pages
        for path in store_files(e.config.storage_dir)[0]:
            drop_cache(path)
    new = [f"new-{i}" for i in range(nwrites)]
    _fill(e, new, range(nreads, nreads + nwrites))
    pids = stop_workers(e)
    try:
        rop = e.prefetch(old, range(nreads + nwrites, 2 * nreads + nwrites))
        wop = e.backup(new, range(nreads, nreads + nwrites))
    finally:
        cont(pids)
    assert e.wait(wop, 30) and e.wait(rop, 30)
    assert rop.status == "ok" and wop.status == "ok"
    assert not wrong_pages(e, rop, _allowed(e))
    assert e.exists(new) == nwrites
    return rop, wop


def test_writes_interleave_with_reads_by_their_share_of_io_time(store):
    """A large write_share: each read earns write credit worth many times its
    own time, so writes start between the reads, not after them: the first
    lands while the reads still go on (48 cold 2 MiB reads from the disk take
    far longer than one 2 MiB write into the page cache)."""
    with make(store, geo=BIG, pages=104, workers=1, write_share=0.95) as e:
        rop, wop = _queued_reads_and_writes(e, 48, 4, cold=True)
        assert wop.landed_seq.min() < rop.landed_seq.max(), (rop.landed_seq, wop.landed_seq)


def test_a_tiny_write_share_lets_every_read_land_first_and_writes_still_complete(store):
    """A tiny write_share: 24 reads earn no write's worth of credit, so every
    read lands before the first write; then, with no read waiting, the writes
    go (the helper checks they all landed)."""
    with make(store, geo=MID, pages=64, workers=1, write_share=1e-6) as e:
        rop, wop = _queued_reads_and_writes(e, 24, 4)
        assert rop.landed_seq.max() < wop.landed_seq.min(), (rop.landed_seq, wop.landed_seq)


@pytest.mark.parametrize("depth", [1, 2])
def test_slow_writes_take_no_more_than_their_share_of_a_prefetchs_time(store, depth):
    """What a user sees: a backup of slow writes (fdatasync per page, on the
    test's real disk) is queued when a prefetch of cached pages comes. Writes
    may take at most `write_share` of the worker's I/O time while the reads
    wait, so the writes that land before the prefetch's last read are at most
    one (its cost is known only once it ran) plus what the reads' time
    earned: sum(read io) * share / (1 - share) / (a write's cost, taken as
    half the mean: writes vary). A page count (a write per 8 reads) let 11
    of these slow writes ahead of the prefetch's last read."""
    share = 0.1
    with make(store, geo=MID, pages=256, workers=1, fsync="data", io_depth=depth,
              write_share=share) as e:
        nreads, nwrites = 96, 16
        rop, wop = _queued_reads_and_writes(e, nreads, nwrites)
        read_ns, write_ns = rop.io_ns / nreads, wop.io_ns / nwrites
        if write_ns < 3 * read_ns:
            pytest.skip(f"fdatasync is not slow here (write {write_ns / 1e3:.0f} us, "
                        f"read {read_ns / 1e3:.0f} us): nothing to share")
        earned = rop.io_ns * share / (1 - share)
        allowed = 1 + int(earned // (write_ns * 0.5))
        before = int((wop.landed_seq < rop.landed_seq.max()).sum())
        assert before <= allowed, (before, allowed, read_ns, write_ns)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_read_that_arrives_while_a_write_is_in_flight_does_not_wait_for_it(store, depth):
    """A prefetch that comes while the worker is inside a slow write (2 MiB
    and fdatasync) lands before that write finishes: at depth 1 the write
    runs on the worker's write lane, not on the thread that serves reads."""
    with make(store, geo=BIG, pages=16, workers=1, fsync="data", io_depth=depth) as e:
        backup(e, ["old"], [0])
        busy = e._control.heartbeat[0]
        for attempt in range(5):
            new = f"new-{attempt}"
            _fill(e, [new], [1])
            wop = e.backup([new], [1])
            t0 = time.monotonic()
            while not busy.any() and time.monotonic() - t0 < 10:
                pass  # spin: the write may last only milliseconds
            rop = e.prefetch(["old"], [2])
            e.poll()
            in_flight = not wop.done  # the write had not finished when the read was queued
            assert e.wait(rop, 30) and e.wait(wop, 30)
            assert rop.status == "ok" and wop.status == "ok"
            if in_flight:
                break
        else:
            pytest.skip("no write here lasted long enough to queue a read behind it")
        assert not wrong_pages(e, rop, _allowed(e))
        assert rop.landed_seq.max() < wop.landed_seq.min(), (rop.landed_seq, wop.landed_seq)


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


def _stalled_pair(e):
    """Both workers stopped; a read and a write queued at each. Returns
    (pids, read op, write op, index of worker A's pages, of worker B's)."""
    old = ["old-0", "old-1"]
    backup(e, old, range(2))
    new = ["new-0", "new-1"]
    _fill(e, new, range(2, 4))
    pids = stop_workers(e)
    rop = e.prefetch(old, range(4, 6))   # page j goes to worker (start + j) % 2
    wop = e.backup(new, range(2, 4))
    return pids, rop, wop


def _pos_at(op, worker) -> int:
    return int(np.flatnonzero(op.worker_of == worker)[0])


def test_a_write_waits_while_another_worker_still_has_reads(store):
    """Reads first across workers: B, done with its own read, holds its write
    while A's read is outstanding (one device: a write takes a read's bandwidth)."""
    with make(store, geo=MID, pages=8, workers=2) as e:
        pids, rop, wop = _stalled_pair(e)
        a, b = 0, 1
        try:
            cont([pids[b]])                      # only B runs
            rb, wb = _pos_at(rop, b), _pos_at(wop, b)
            t0 = time.monotonic()
            while rop.page_status[rb] == 0 and time.monotonic() - t0 < 10:
                e.poll()
                time.sleep(0.005)
            assert rop.page_status[rb] == 1, "B never did its own read"
            time.sleep(0.1)                       # well inside WRITE_DEFER_MAX_S (0.5 s)
            e.poll()
            assert wop.page_status[wb] == 0, "B wrote while A's read was outstanding"
        finally:
            cont(pids)
        assert e.wait(rop, 30) and e.wait(wop, 30)
        assert rop.status == "ok" and wop.status == "ok"
        assert not wrong_pages(e, rop, _allowed(e))
        # B's write landed only after A's read.
        assert wop.landed_seq[wb] > rop.landed_seq[_pos_at(rop, a)]


def test_a_deferred_write_still_goes_when_reads_elsewhere_never_finish(store):
    """The backstop: reads stuck at another worker delay a write by
    WRITE_DEFER_MAX_S at most, never for ever."""
    with make(store, geo=MID, pages=8, workers=2) as e:
        pids, rop, wop = _stalled_pair(e)
        a, b = 0, 1
        try:
            cont([pids[b]])                      # A stays stopped: its read never finishes
            wb = _pos_at(wop, b)
            t0 = time.monotonic()
            while wop.page_status[wb] == 0 and time.monotonic() - t0 < 10:
                e.poll()
                time.sleep(0.01)
            assert wop.page_status[wb] == 1, "B's write stalled behind A's stuck read"
            assert rop.page_status[_pos_at(rop, a)] == 0  # A really was stuck all along
        finally:
            cont(pids)
        assert e.wait(rop, 30) and e.wait(wop, 30)
        assert rop.status == "ok" and wop.status == "ok"


# 4 MiB pages: a buffered write is five pieces (workers.fileio.WRITE_PIECE_BYTES),
# so a worker caught with under 2 MiB of its temp file written has pieces left.
HUGE = dict(num_layers=32, num_kv_heads=8, head_dim=128, page_size=32)


def _early(path: str) -> bool:
    if naming.TMP_MARK not in path:
        return False
    try:
        return os.stat(path).st_size < 2 << 20
    except OSError:
        return False


def _write_caught_early(e, slot: int, at_worker=None, tries: int = 40):
    """Back up one page with every worker stopped, and step the one that takes
    it until it is inside the write with under 2 MiB of the temp file written
    (left stopped, the others too). A write into the page cache mostly ends
    within one step: a try is given up as soon as the write got past 2 MiB or
    ended, and made again with a new key and the next step length (five tries
    of 5 s each used to spin on after such a miss, and often skipped). Returns
    (write op, pids) or skips."""
    steps = (0.0002, 0.0001, 0.00005, 0.00002, 0.00001)
    for attempt in range(tries):
        key = f"new-{attempt}"
        _fill(e, [key], [slot])
        pids = stop_workers(e)
        wop = e.backup([key], [slot])
        pid, done = pids[int(wop.worker_of[0])], page_file(e, key)

        def caught():
            held = [p for p in open_files(pid) if naming.TMP_MARK in p]
            if any(_early(p) for p in held):
                return "early"
            return "missed" if held or os.path.exists(done) else None

        if stop_when(pid, caught, timeout_s=5.0, run_s=steps[attempt % len(steps)]) == "early":
            return wop, pids
        cont(pids)
        assert e.wait(wop, 30) and wop.status == "ok"
        os.unlink(done)  # a missed try's 4 MiB page is never read: not left to the next session
    cont(pids)
    pytest.skip(f"never caught a worker early in its write ({tries} tries)")


@pytest.mark.parametrize("depth", [1, 2])
def test_a_write_already_running_when_a_prefetch_comes_pauses_for_its_reads(store, depth):
    """What SGLang's controller does every time (a backup, then 1 ms later a
    prefetch): the write started free, with no read anywhere, and the reads
    arrive while it is half done. With a tiny write_share the reads' time
    earns it nothing, so it pauses between its pieces and every read lands
    first; then it finishes, intact. Buffered, at depth 1 (the write lane)
    and 2 (lanes)."""
    nreads = 32
    with make(store, geo=HUGE, pages=2 * nreads + 1, workers=1, io_depth=depth,
              write_share=1e-6) as e:
        old = [f"old-{i}" for i in range(nreads)]
        backup(e, old, range(nreads))
        wop, pids = _write_caught_early(e, nreads)
        try:
            rop = e.prefetch(old, range(nreads + 1, 2 * nreads + 1))  # queued mid-write
        finally:
            cont(pids)
        _reads_landed_first(e, rop, wop)
        # The paused write's file is whole: read back, it is the page that was written.
        back = prefetch(e, wop.keys, [nreads + 1])
        assert back.status == "ok" and not wrong_pages(e, back, _allowed(e))


def test_a_paused_write_still_finishes_when_reads_elsewhere_never_do(store):
    """A write paused for reads at another worker goes on after
    WRITE_DEFER_MAX_S whatever those reads do: pausing never starves a backup."""
    with make(store, geo=HUGE, pages=8, workers=2) as e:
        backup(e, ["old-0", "old-1"], range(2))
        wop, pids = _write_caught_early(e, 2)
        b = int(wop.worker_of[0])
        a = 1 - b
        try:
            rop = e.prefetch(["old-0", "old-1"], [3, 4])  # one read at each worker
            cont([pids[b]])                                # A stays stopped
            assert e.wait(wop, 10), "the write stayed paused behind A's stuck read"
            assert wop.status == "ok"
            assert rop.page_status[_pos_at(rop, a)] == 0  # A really was stuck all along
        finally:
            cont(pids)
        assert e.wait(rop, 30) and rop.status == "ok"
        assert not wrong_pages(e, rop, _allowed(e))
