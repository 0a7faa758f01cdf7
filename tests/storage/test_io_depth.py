"""Depth per worker (`io_depth`, workers.lanes): several I/Os in flight in one worker.

What a user notices: the bytes are the same as with one I/O at a time (both
layouts, reads and writes mixed, O_DIRECT where the filesystem allows it); a
page whose read hangs (a FUSE directory that answers late stands in for a
hung network filesystem) does not hold up the worker's other pages; reads still go first; a bad
setting is refused before any worker starts; nothing is left behind.
"""
import os

import pytest

from faultkit import MID, backup, content, fingerprint, make, prefetch, put, run_child, \
    wrong_pages
from hicache_mp import EngineConfig
from storagekit import cont, stop_workers


def _allowed(e):
    return lambda k: {fingerprint(content(k, e.geometry.page_bytes))}


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_pages_round_trip_byte_exact_with_reads_and_writes_mixed(store, layout):
    with make(store, layout=layout, geo=MID, pages=96, workers=2, io_depth=4) as e:
        assert e.metrics()["io_depth"] == 4
        old = [f"old-{i}" for i in range(32)]
        assert backup(e, old, range(32)).status == "ok"
        new = [f"new-{i}" for i in range(32)]
        for k, s in zip(new, range(32, 64)):
            put(e, s, content(k, e.geometry.page_bytes))
        wop = e.backup(new, range(32, 64))
        rop = e.prefetch(old, range(64, 96))  # reads run beside the writes
        assert e.wait(wop, 30) and e.wait(rop, 30)
        assert wop.status == "ok" and rop.status == "ok", (wop.status_counts(), rop.status_counts())
        assert not wrong_pages(e, rop, _allowed(e))
        back = prefetch(e, new, range(64, 96))
        assert back.status == "ok" and not wrong_pages(e, back, _allowed(e))


STALL = """
import os, threading
import eiofuse
from faultkit import MID, backup, content, fingerprint, make, page_file, wrong_pages
depth, others_finish = args[1], args[2]
eiofuse.private_mounts()     # before the workers start: they share the mount
hold = threading.Event()
with make(args[0], geo=MID, pages=32, workers=1, io_depth=depth) as e:
    pb = e.geometry.page_bytes
    allowed = lambda k: {fingerprint(content(k, pb))}
    keys = [f"k-{i}" for i in range(9)]
    result["backup"] = backup(e, keys, range(9)).status
    path = page_file(e, keys[0])
    leaf = os.path.dirname(path)
    result["alone"] = os.listdir(leaf) == [os.path.basename(path)]
    # k-0's fan-out leaf becomes a filesystem whose reads hang until `hold`
    fuse = eiofuse.mount_eio(leaf, {os.path.basename(path): os.stat(path).st_size}, hold)
    try:
        slow = e.prefetch(keys[:1], [10])
        rest = e.prefetch(keys[1:], range(11, 19))
        # With lanes, the rest lands (waited for); with one, it is queued behind
        # the hung read until `hold` is set: nothing can land meanwhile, so a
        # second of not landing shows it as well as five.
        result["finished"] = e.wait(rest, 5.0 if others_finish else 1.0)
        result["rest_early"] = rest.status_counts()
        result["slow_done_early"] = slow.done
        result["rest_right_early"] = result["finished"] and rest.status == "ok" and \
            not wrong_pages(e, rest, allowed)
    finally:
        hold.set()               # never leave a lane hung: close() would wait for it
    result["ended"] = e.wait(slow, 10) and e.wait(rest, 10)
    result["reads"] = fuse.reads
    result["slow"] = slow.status_counts()
    result["rest_right"] = rest.status == "ok" and not wrong_pages(e, rest, allowed)
    fuse.unmount()
"""


@pytest.mark.parametrize("depth, others_finish", [(3, True), (1, False)])
def test_a_stalled_page_holds_up_the_other_pages_only_without_depth(store, depth, others_finish):
    """A hung network-filesystem read, for real: a FUSE directory whose READ is
    answered only when the test says so (tests/faults/eiofuse.py, in a child's
    private mount namespace)."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse for a hung read")
    got = run_child(STALL, store, depth, others_finish, unprivileged=False)
    assert got["backup"] == "ok" and got["alone"], got
    assert got["finished"] == others_finish, got
    assert not got["slow_done_early"] and got["reads"] >= 1, got  # it hung in the filesystem
    if others_finish:
        assert got["rest_right_early"], got
    assert got["ended"], got
    assert got["slow"] == {"unreadable": 1}, got  # the filesystem's EIO once it answers
    assert got["rest_right"], got


def test_reads_still_go_before_queued_writes(store):
    """With 2 lanes and writes queued first, the first pages done are reads."""
    # write_share 0.01: six reads cannot earn a write's worth of credit (the
    # default 0.1 could, were a cached 64 KiB read ~0.5 ms on a loaded box).
    with make(store, geo=MID, pages=64, workers=1, io_depth=2, write_share=0.01) as e:
        old = [f"old-{i}" for i in range(6)]
        assert backup(e, old, range(6)).status == "ok"
        new = [f"new-{i}" for i in range(12)]
        for k, s in zip(new, range(6, 18)):
            put(e, s, content(k, e.geometry.page_bytes))
        pids = stop_workers(e)
        try:
            wop = e.backup(new, range(6, 18))   # queued first
            rop = e.prefetch(old, range(32, 38))
        finally:
            cont(pids)
        assert e.wait(wop, 30) and e.wait(rop, 30)
        assert rop.status == "ok" and wop.status == "ok"
        assert not wrong_pages(e, rop, _allowed(e))
        # Every read was dispatched before any write; with two lanes the last
        # read may land just after the first write, never later than that.
        assert wop.landed_seq.min() > sorted(rop.landed_seq)[-2], (rop.landed_seq, wop.landed_seq)


@pytest.mark.parametrize("bad", [-1, 33, 2.5, "four", True])
def test_a_bad_depth_is_refused_before_any_worker(store, bad):
    with pytest.raises(ValueError, match="io_depth"):
        EngineConfig(storage_dir=store, io_depth=bad)


def test_a_depth_written_as_text_is_parsed(store):
    # Extra configs and hand-written JSON give numbers as strings (config.parse_value).
    assert EngineConfig(storage_dir=store, io_depth="4").io_depth == 4


def test_auto_depth_is_two_with_direct_io_and_one_buffered(store):
    cfg = EngineConfig(storage_dir=store)
    assert cfg.io_depth == 0 and cfg.resolved_io_depth(True) == 2 and cfg.resolved_io_depth(False) == 1
    assert EngineConfig(storage_dir=store, io_depth=3).resolved_io_depth(True) == 3
