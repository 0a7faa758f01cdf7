"""Capacity: the evictor keeps the store under `storage_max_bytes` (and above
`storage_min_free_bytes`) while reads go on, by last access, never removing a
page that an op in flight names; writes that would cross a limit are dropped
with a status at once; the index forgets what was evicted.

Reaches inside: the engine's `_evictor` (the evictor's process, to SIGSTOP it
while it lists the store under its lease: the public `worker_pids()` names
the I/O workers only).
"""
import os
import signal
import time

import pytest

from faultkit import BIG, a_pass_begun_now_ended, backup, content, fingerprint, make, \
    page_file, prefetch, put, settle, stop_during_io, store_files, wake_evictor, wrong_pages
from shm import PageGeometry
from workers.evictlease import LEASE_NAME
from workers.evictor import headroom_bytes
from storagekit import ALIGNED, FILE_BYTES, cont, mount, need_root, stop_workers, store_bytes, \
    umount
from workers import naming, tmpfiles


def _allowed(e):
    return lambda k: {fingerprint(content(k, e.geometry.page_bytes))}


def _limited(store, files, **kw):
    return make(store, geo=ALIGNED, storage_max_bytes=files * FILE_BYTES,
                eviction_interval_s=0.2, **kw)


def _evicted(e, n, timeout_s=10.0):
    """Wait until the engine has heard of at least n evictions."""
    return settle(lambda: e.poll() is not None and e.metrics()["evicted_pages"] >= n, timeout_s)


def test_store_stays_under_max_bytes_while_serving_reads(store):
    limit = 24 * FILE_BYTES
    with _limited(store, 24, pages=32, workers=2) as e:
        written = []
        peak = 0
        for rnd in range(10):
            keys = [f"r{rnd}-{i}" for i in range(6)]
            slots = range(6 * (rnd % 2), 6 * (rnd % 2) + 6)
            op = backup(e, keys, slots)
            peak = max(peak, store_bytes(store))
            ok = [k for k, s in zip(keys, op.page_status.tolist()) if s == 1]
            written.extend(ok)
            got = prefetch(e, ok, range(12, 12 + len(ok)))
            assert got.status == "ok", (rnd, got.status_counts())  # the newest pages are there
            assert not wrong_pages(e, got, _allowed(e))
            peak = max(peak, store_bytes(store))
            assert peak <= limit, f"store at {peak} bytes, limit {limit} (round {rnd})"
        assert _evicted(e, 30)
        a_pass_begun_now_ended(e)
        assert store_bytes(store) <= limit
        # The index forgot what was evicted: it claims exactly the pages on disk.
        claimed = {k for k in written if e.exists([k])}
        on_disk = {k for k in written if os.path.exists(page_file(e, k))}
        assert claimed == on_disk and len(on_disk) < len(written)
        assert e.exists(["r0-0"]) == 0
        assert e.metrics()["evicted_bytes"] >= 30 * FILE_BYTES


def test_eviction_follows_last_access_recorded_by_workers(store):
    with _limited(store, 16, pages=32, workers=2) as e:
        old = [f"k{i}" for i in range(11)]
        backup(e, old, range(11))
        before = os.stat(page_file(e, "k0")).st_mtime_ns
        time.sleep(1.1)
        hot, cold = old[:2], old[2:]
        assert prefetch(e, hot, range(11, 13)).status == "ok"  # workers stamp these as used
        assert os.stat(page_file(e, "k0")).st_mtime_ns > before
        new = ["n0", "n1"]
        backup(e, new, range(13, 15))  # 13 files: over the trigger (12)
        # A pass evicts down to 8 files by its estimate, which counts writes in
        # flight (and may count one twice): 5 to 9 pages, the least recently used.
        assert _evicted(e, 4)
        a_pass_begun_now_ended(e)
        for k in hot + new:
            assert os.path.exists(page_file(e, k)), f"recently used {k} was evicted"
        gone = [k for k in cold if not os.path.exists(page_file(e, k))]
        assert len(gone) == e.metrics()["evicted_pages"] >= 4, gone


def test_pages_in_flight_survive_eviction(store):
    with _limited(store, 16, pages=32, workers=2) as a:
        old = [f"k{i}" for i in range(10)]
        backup(a, old, range(10))
        queued = old[:4]                    # the least recently used: first in line to go
        pids = stop_workers(a)
        try:
            op = a.prefetch(queued, range(10, 14))
            with make(store, geo=ALIGNED, pages=8, workers=1) as b:   # another engine, no limit
                backup(b, [f"b{i}" for i in range(6)], range(6))      # 16 files: over the trigger
            # A pass evicts down to 8 files (8 pages); one that ran while b was still
            # writing removed fewer. Either way, the oldest pages that are not in flight.
            assert _evicted(a, 4)
            a_pass_begun_now_ended(a)
            for k in queued:
                assert os.path.exists(page_file(a, k)), f"{k} was evicted while in flight"
            gone = [k for k in old[4:] if not os.path.exists(page_file(a, k))]
            assert len(gone) == min(6, a.metrics()["evicted_pages"]), gone
        finally:
            cont(pids)
        assert a.wait(op, 30) and op.status == "ok", op.status_counts()
        assert not wrong_pages(a, op, _allowed(a))


def test_write_over_max_bytes_is_dropped_with_a_status_never_stalled(store):
    with _limited(store, 12, pages=16, workers=2) as e:
        # Bytes the evictor may not remove: a live writer's temp file (ours).
        d = os.path.join(store, "ab", "cd")
        os.makedirs(d, mode=0o700)
        tmp = tmpfiles.tmp_name(os.path.join(d, "ab" * 32 + naming.PAGE_SUFFIX), 1)
        with open(tmp, "wb") as f:
            f.truncate(13 * FILE_BYTES)
        try:
            a_pass_begun_now_ended(e)  # it saw the store over its limit
            t0 = time.monotonic()
            for k, s in zip(["x0", "x1", "x2"], range(3)):
                put(e, s, content(k, e.geometry.page_bytes))
            op = e.backup(["x0", "x1", "x2"], range(3))
            assert e.wait(op, 5), "backup stalled"
            assert time.monotonic() - t0 < 5
            assert op.status_counts() == {"dropped": 3}
            assert e.metrics()["write_status"]["dropped"] == 3
            assert not os.path.exists(page_file(e, "x0"))
        finally:
            os.unlink(tmp)
        a_pass_begun_now_ended(e)  # it saw the space back
        assert backup(e, ["x0"], [0]).status == "ok"


def test_min_free_bytes_is_kept_on_a_small_filesystem(tmp_path):
    need_root()
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    if not mount(mnt, "tmpfs", "size=4m", "mode=0700"):
        import pytest
        pytest.skip("cannot mount a tmpfs")
    try:
        floor = 2 << 20
        with make(mnt, geo=ALIGNED, pages=16, workers=2, storage_min_free_bytes=floor,
                  eviction_interval_s=0.2) as e:
            for rnd in range(8):
                keys = [f"m{rnd}-{i}" for i in range(8)]
                op = backup(e, keys, range(8))
                assert "nospace" not in op.status_counts(), op.status_counts()
                vfs = os.statvfs(mnt)
                assert vfs.f_bavail * vfs.f_frsize >= floor
            assert _evicted(e, 8)
    finally:
        umount(mnt)


# --- a write in flight is counted once -------------------------------------------
def _hold_with_temp_written(pid, file_bytes):
    """Step the stopped worker `pid` until it holds its page write's temp file
    open with every byte written (in the fdatasync before the rename); the
    worker is left stopped. None if every step ran past that point."""
    def written(path):
        try:
            return naming.TMP_MARK in path and os.path.getsize(path) == file_bytes
        except OSError:
            return False
    return stop_during_io(pid, written, timeout_s=5.0)


def _listing_first_part_under_lease(dirs, leased):
    """The evictor's state wanted: holding the eviction lease of directory
    `leased`, listing the fan-out directories of the first part (its root or
    a top level open): no page file directory of any part visited yet."""
    first = dirs[0]

    def wanted(path):
        if not os.path.exists(os.path.join(leased, LEASE_NAME)):
            return False
        rel = os.path.relpath(path, first)
        return rel == "." or (len(rel) == 2 and os.path.isdir(path))
    return wanted


def _part(dirs, path):
    return next(i for i, d in enumerate(dirs) if path.startswith(d + os.sep))


def _pages_per_part(dirs):
    return [len(store_files(d)[0]) for d in dirs]


@pytest.mark.parametrize("met", ["temp file", "renamed page"])
@pytest.mark.parametrize("ndirs", [1, 2])
def test_a_pass_counts_a_write_in_flight_once(tmp_path, ndirs, met):
    """Engine E (one worker, a limit of 24 pages per directory) has one page
    write in flight; every directory holds as many pages (another engine's)
    as E's trigger allows, so the write's directory is one page past it.
    E's pass must count that write once, as its reservation or as the file
    its scan meets: the write's directory is left at the hysteresis target
    once the write lands, and (striped) the other directory, which no write
    of E's goes to, is not touched. `temp file`: the worker is held with its
    temp file written for the whole pass. `renamed page`: the evictor is held
    after its pre-scan snapshot, under the lease, and the write finishes
    (renamed, INFLIGHT cleared) before its scan reaches any page directory."""
    dirs = [str(tmp_path / f"drive{i}" / "kv") for i in range(ndirs)]
    spec = ",".join(dirs)
    file_bytes = 4096 + PageGeometry(**BIG).page_bytes
    share = 24  # page files per directory
    part_headroom = max(headroom_bytes(share * ndirs * file_bytes, 0, file_bytes) // ndirs, 1)
    trigger = share - part_headroom // file_bytes           # a part evicts above this
    target = share - 2 * part_headroom // file_bytes        # ...down to this
    if met == "renamed page":
        # Empty fan-out directories (a scan lists any two-character name): a longer
        # listing phase, where the evictor is held. (Held with its temp file, the
        # worker waits out the whole pass: no need. 2,592 directories per drive
        # cost ~0.5 s to make and ~0.3 s for pytest to remove on a 2-core box.)
        chars = "0123456789abcdefghijklmnopqrstuvwxyz"
        for d in dirs:
            for top in (a + b for a in chars for b in chars):
                os.makedirs(os.path.join(d, top, "00"), mode=0o700)
    # fsync: a write spends milliseconds between its last byte and its rename.
    cfg = dict(geo=BIG, pages=4, workers=1, storage_max_bytes=share * ndirs * file_bytes,
               eviction_interval_s=3600.0, fsync="data")  # passes only when the test asks
    with make(spec, **cfg) as e:
        pb = e.geometry.page_bytes
        with make(spec, geo=BIG, pages=8, workers=1) as other:   # no limit
            keys = iter(f"p{i}" for i in range(10 ** 6))
            want = [trigger] * ndirs
            while any(want):
                batch = []
                while len(batch) < 8 and any(want):
                    k = next(keys)
                    p = _part(dirs, page_file(other, k))
                    if want[p]:
                        want[p] -= 1
                        batch.append(k)
                backup(other, batch, range(len(batch)))
        assert _pages_per_part(dirs) == [trigger] * ndirs
        worker = e.worker_pids()[0]
        os.kill(worker, signal.SIGSTOP)
        tmp = None
        for attempt in range(5):  # a write that ran past the window is one more page
            key = f"held{attempt}"
            put(e, attempt % 4, content(key, pb))
            op = e.backup([key], [attempt % 4])
            tmp = _hold_with_temp_written(worker, file_bytes)
            if tmp:
                break
            os.kill(worker, signal.SIGCONT)
            assert e.wait(op, 30) and op.status == "ok"
            os.kill(worker, signal.SIGSTOP)
        assert tmp, "never held the worker with its temp file written"
        held = _part(dirs, tmp)
        before = [n + (p == held) for p, n in enumerate(_pages_per_part(dirs))]
        expect = [target if n > trigger else n for n in before]
        assert expect[held] == target  # the pass must evict there
        evictor = e._evictor.proc.pid
        try:
            if met == "temp file":
                wake_evictor(e)
                assert _evicted(e, sum(before) - sum(expect))
                a_pass_begun_now_ended(e)
            else:
                os.kill(evictor, signal.SIGSTOP)
                wake_evictor(e)
                assert stop_during_io(evictor, _listing_first_part_under_lease(dirs, dirs[held])), \
                    "never held the evictor listing the store under its lease"
                os.kill(worker, signal.SIGCONT)
                assert e.wait(op, 30) and op.status == "ok"
                assert os.path.exists(page_file(e, key)) and not os.path.exists(tmp)
                os.kill(evictor, signal.SIGCONT)
                assert _evicted(e, sum(before) - sum(expect))
                a_pass_begun_now_ended(e)
        finally:
            os.kill(evictor, signal.SIGCONT)
            os.kill(worker, signal.SIGCONT)
        assert e.wait(op, 30) and op.status == "ok"
        pages = _pages_per_part(dirs)
        assert pages == expect, (f"pages per directory {pages}, expected {expect} (target "
                                 f"{target}, evicted {e.metrics()['evicted_pages']})")
        assert e.metrics()["evicted_pages"] == sum(before) - sum(expect)
        assert os.path.exists(page_file(e, key))  # the newest page stays
