"""Capacity across nodes: `storage_max_bytes` is the size of the shared store.

Two engines on two mounts of one volume, both with the same limit, write
new pages as fast as they can. Both evictors see the whole store near its
limit at the same moments; the eviction lease (workers.evictlease) lets one
of them at a time make room, measured afresh, so together they keep the
store near the limit instead of each removing what was needed and leaving
it far below (a cache emptied for nothing).
"""
import os
import threading
import time

from hicache_mp.bench import jfs
from faultkit import MID, a_pass_begun_now_ended, content, evictor_passes, make, put, settle, \
    wake_evictor
from workers import evictlease
from workers.evictlease import LEASE_NAME
from workers.evictor import headroom_bytes
from workers.stores import open_store

FILE = 4096 + 65536  # one MID page file
LIMIT = 64 * FILE


def _scan(root):
    """(pages, bytes of pages and temp files) of a store."""
    found = open_store(root).scan()
    return found.pages, found.total_bytes


def _writer(eng, tag, rounds, errors):
    try:
        pb = eng.geometry.page_bytes
        for r in range(rounds):
            keys = [f"{tag}-{r}-{i}" for i in range(16)]
            for i, k in enumerate(keys):
                put(eng, i, content(k, pb))
            op = eng.backup(keys, range(16))
            if not eng.wait(op, 60):
                errors.append(f"{tag}: backup hung")
    except BaseException as exc:  # reported by the test
        errors.append(repr(exc))


def test_two_nodes_evictors_keep_the_shared_store_near_its_limit(nodes, volume):
    h = headroom_bytes(LIMIT, 0, FILE)
    samples, errors = [], []
    stop = threading.Event()
    # The store's size as the metadata engine has it, one committed state per
    # sample: a walk through a mount lasted up to 0.44 s under load, long
    # enough to read 55 files around a pass that left 56, and 67 against the
    # limit of 64 (jfs.MetaView).
    view = jfs.MetaView(volume.meta, nodes.a)

    def sample():
        while not stop.is_set():
            samples.append(view.store_files()[1])
            time.sleep(0.002)

    cfg = dict(geo=MID, pages=16, workers=2, storage_max_bytes=LIMIT, eviction_interval_s=0.05)
    with make(nodes.a, **cfg) as a, make(nodes.b, **cfg) as b:
        watcher = threading.Thread(target=sample)
        watcher.start()
        writers = [threading.Thread(target=_writer, args=(e, t, 14, errors))
                   for e, t in ((a, "a"), (b, "b"))]
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        # Until both evictors are done: the store inside its limit, every removal
        # popped from the evict rings, nothing changing for a while (three looks,
        # 0.6 s). Inside the limit is enough: the writers ended anywhere between
        # the hysteresis target and the limit, where no pass runs (waiting for
        # LIMIT - h there ran to the deadline, 10 s).
        seen, deadline = [], time.monotonic() + 10
        while time.monotonic() < deadline:
            a.poll(), b.poll()
            seen.append((a.metrics()["evicted_pages"], b.metrics()["evicted_pages"],
                         _scan(nodes.a)[1]))
            if len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3] and seen[-1][2] <= LIMIT:
                break
            time.sleep(0.3)
        stop.set()
        watcher.join()
        view.close()
        evicted = a.metrics()["evicted_pages"], b.metrics()["evicted_pages"]
        written = sum(e.metrics()["write_pages_ok"] for e in (a, b))
    assert not errors, errors
    on_disk = len(_scan(nodes.a)[0])
    final = _scan(nodes.a)[1]
    full = next(i for i, s in enumerate(samples) if s >= LIMIT - 2 * h)
    low, high = min(samples[full:]), max(samples)
    print(f"\ncapacity: limit {LIMIT // FILE} files, headroom {h // FILE}; lowest after full "
          f"{low / FILE:.1f}, highest {high / FILE:.1f}, final {final / FILE:.1f} files; "
          f"evicted {evicted}, written {written}")
    assert sum(evicted) > 0 and written > LIMIT // FILE
    # One evictor at a time: each page removed once, by one of them. Two at once
    # walk the same oldest-first list and both remove (and report) the same pages.
    assert sum(evicted) == written - on_disk, (evicted, written, on_disk)
    # ...and together they leave the store near its limit: never below its
    # hysteresis target (LIMIT - 2h) less the room a pass makes ahead for the
    # writes queued behind one waiting at the limit (decision 84: at most the
    # lease holder's one backup of 16 pages, until they land), at the end no
    # more than the limit. A pass counts each write in flight once
    # (workers.inflight), so it removes what the target asks and no more. Two
    # evictors at once are caught exactly above (pages removed twice).
    assert low >= LIMIT - 2 * h - 16 * FILE, f"store fell to {low / FILE:.1f} files"
    assert final <= LIMIT
    # The lease is given back (seen through either mount once its entry cache expires).
    assert settle(lambda: not any(os.path.exists(os.path.join(d, LEASE_NAME))
                                  for d in (nodes.a, nodes.b)), 3)


def _evicted_then_idle(e, n, timeout_s=10.0):
    """Wait until e has heard of n evictions, then for a pass of its evictor
    begun after that to end (one that removed more is counted by then)."""
    assert settle(lambda: e.poll() is not None and e.metrics()["evicted_pages"] >= n,
                  timeout_s, 0.01), e.metrics()["evicted_pages"]
    a_pass_begun_now_ended(e)


def _fill(root, keys):
    with make(root, geo=MID, pages=16) as filler:   # no limit: fills past it
        pb = filler.geometry.page_bytes
        for at in range(0, len(keys), 16):
            for i, k in enumerate(keys[at:at + 16]):
                put(filler, i, content(k, pb))
            op = filler.backup(keys[at:at + 16], range(16))
            assert filler.wait(op, 60) and op.status == "ok"


def test_an_evictor_waits_while_another_node_holds_the_lease(nodes):
    """Node B's evictor holds the store's eviction lease (taken here through
    mount b, as B's evictor takes it): node A's evictor, though the store is
    far past the limit, removes nothing until B gives the lease back, then
    makes room once. A lease whose holder died (not refreshed for LEASE_S)
    is broken and taken over."""
    cfg = dict(geo=MID, pages=16, workers=1, storage_max_bytes=LIMIT, eviction_interval_s=0.05)
    with make(nodes.a, **cfg) as a:
        held = evictlease.take(nodes.b)
        assert held is not None and evictlease.take(nodes.a) is None  # one holder at a time
        _fill(nodes.a, [f"old{i}" for i in range(112)])
        passes = evictor_passes(a)
        wake_evictor(a)
        # five of A's passes (a second of them here), each one past the limit with the
        # lease held elsewhere
        assert settle(lambda: evictor_passes(a) >= passes + 5, 10, 0.01)
        a.poll()
        assert a.metrics()["evicted_pages"] == 0 and len(_scan(nodes.a)[0]) == 112
        held.release()
        _evicted_then_idle(a, 56)  # once mount a's entry cache lets the lease go
        assert a.metrics()["evicted_pages"] == 112 - len(_scan(nodes.a)[0]) == 56
        # A holder that died: its lease is not refreshed; after LEASE_S it is broken.
        # The store is filled while the lease is still fresh, then aged: a
        # takeover during the fill (a loaded box's fill outlasting the mount's
        # attribute cache) made room once mid-fill and left the last pages
        # under the limit (86 evicted, not 88).
        dead = evictlease.take(nodes.b)
        _fill(nodes.a, [f"new{i}" for i in range(32)])
        old = time.time() - evictlease.LEASE_S - 1
        os.utime(os.path.join(nodes.b, evictlease.LEASE_NAME), (old, old))
        _evicted_then_idle(a, 56 + 32)  # once mount a's attribute cache shows its age
        assert a.metrics()["evicted_pages"] == 56 + 32 and not dead.held()
