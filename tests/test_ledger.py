"""The ledger's rules against the ledger alone (hicache_mp/engine/ledger.py).

No engine, no workers, no shared memory: an OpLedger over an index of an
empty store in tmp_path, and Op objects made by hand, as the engine makes
them. What each rule does to the books: admit reserves and pins, apply and
apply_many free and count, settle numbers a drain in landed order and picks
bulk or page by page, retire frees the slots, fail_worker settles a lost
worker's pages, and a fence holds a killed one's slots and ops until unfence. Quick: the whole file runs in well under a second.
"""
import numpy as np
import pytest

from hicache_mp.engine.index import StoreIndex
from hicache_mp.engine.ledger import OpLedger
from hicache_mp.engine.ops import READ, WRITE, Op
from shm.ring import RECORD_DTYPE
from workers import status as st
from workers.control import pin_slots

PAGES = 16


@pytest.fixture
def index(tmp_path):
    index = StoreIndex(str(tmp_path))
    index.store.create()
    return index


@pytest.fixture
def ledger(index):
    return OpLedger(PAGES, backup_budget=4, index=index)


def make_op(ledger, kind, slots, worker_of=None):
    slots = np.asarray(slots, dtype=np.int64)
    digests = [bytes([i + 1]) * 32 for i in range(len(slots))]
    ledger.check_free(slots)
    op = Op(ledger.new_id(), kind, [f"k{i}" for i in range(len(slots))], slots, digests,
            4096, "wait_complete", float("inf"))
    op.digest_bytes = b"".join(digests)
    op.worker_of = np.zeros(len(slots), dtype=np.uint16) if worker_of is None else \
        np.asarray(worker_of, dtype=np.uint16)
    return op


def records(op, codes, positions=None):
    positions = range(op.num_pages) if positions is None else positions
    recs = np.zeros(len(codes), dtype=RECORD_DTYPE)
    recs["op_id"] = op.id
    recs["page_pos"] = list(positions)
    recs["status"] = codes
    return recs


def test_admit_reserves_the_slots_and_pins_the_pages(ledger):
    op = make_op(ledger, READ, [3, 4, 5])
    assert ledger.admit(op, 0)
    assert len(ledger) == 1 and ledger.get(op.id) is op
    assert int(np.count_nonzero(ledger.pins)) == 3
    assert ledger.pins[pin_slots(op.digest_bytes)].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="still in flight"):
        ledger.check_free(np.array([5, 6]))
    assert ledger.metrics(0, 4096)["pages_in_flight"] == 3


def test_apply_frees_a_page_counts_it_and_retires_the_done_op(ledger):
    op = make_op(ledger, READ, [0, 1])
    ledger.admit(op, 0)
    ledger.apply(op, 1, st.OK, 10, 0, 100)
    assert op.landed_seq.tolist() == [-1, 0] and ledger.seq == 1
    assert len(ledger) == 1
    ledger.apply(op, 0, st.OK, 10, 0, 200)
    assert op.done and op.status == "ok" and len(ledger) == 0
    assert int(np.count_nonzero(ledger.pins)) == 0
    ledger.check_free(np.array([0, 1]))  # the slots are free again
    m = ledger.metrics(300, 4096)
    assert m["read_pages_ok"] == 2 and m["ops_in_flight"] == 0 and m["pages_in_flight"] == 0
    # pages the engine settles itself are no worker completions (waiters note 1)
    assert ledger.worker_pages == 0


def test_a_page_is_settled_once(ledger):
    op = make_op(ledger, READ, [0, 1])
    ledger.admit(op, 0)
    ledger.apply(op, 0, st.WORKER_DIED, 0, 0, 1)
    ledger.apply(op, 0, st.OK, 0, 0, 2)  # a late echo of a page failed with its worker
    assert op.page_status[0] == st.WORKER_DIED and ledger.seq == 1


def test_backups_over_the_budget_end_dropped_at_admission(ledger):
    op = make_op(ledger, WRITE, range(6))  # the budget is 4 pages
    assert ledger.admit(op, 0)
    assert [st.NAMES[c] for c in op.page_status] == ["pending"] * 4 + ["dropped"] * 2
    assert ledger.budget_metrics() == {"backup_budget_pages": 4, "backup_pages_held": 4}
    full = make_op(ledger, WRITE, [10, 11])
    assert not ledger.admit(full, 0)  # nothing fits: the op ends at once
    assert full.done and full.status == "failed"


def test_settle_numbers_a_drain_in_landed_order_bulk_or_page_by_page(ledger):
    for batch_min in (1, 10 ** 9):  # bulk (apply_many), then page by page (apply)
        a = make_op(ledger, READ, [0, 1, 2])
        b = make_op(ledger, READ, [3, 4])
        ledger.admit(a, 0)
        ledger.admit(b, 0)
        seq0, pages0 = ledger.seq, ledger.worker_pages
        recs = np.concatenate([records(a, [st.OK], [2]), records(b, [st.OK, st.MISS]),
                               records(a, [st.OK, st.OK], [0, 1])])
        ledger.settle(recs, batch_min, 5)
        assert (a.landed_seq - seq0).tolist() == [3, 4, 0]
        assert (b.landed_seq - seq0).tolist() == [1, 2]
        assert a.status == "ok" and b.status == "partial" and len(ledger) == 0
        assert ledger.worker_pages == pages0 + 5
    assert ledger.metrics(6, 4096)["misses"] == 2


def test_a_written_page_joins_the_index_and_a_read_miss_leaves_it(ledger, index):
    w = make_op(ledger, WRITE, [0])
    ledger.admit(w, 0)
    ledger.apply(w, 0, st.OK, 0, 0, 1)
    assert w.digests[0] in index.digests
    r = make_op(ledger, READ, [1])  # the same key: the index was stale
    ledger.admit(r, 0)
    ledger.apply(r, 0, st.MISS, 0, 0, 2)
    assert w.digests[0] not in index.digests
    # a damaged page is distrusted: a probe finding its file again is not believed
    d = make_op(ledger, READ, [2])
    ledger.admit(d, 0)
    ledger.apply_many(d, np.array([0]), np.array([st.CORRUPT], dtype=np.uint8),
                      np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int32),
                      np.array([ledger.seq]), 3)
    index.add_found(d.digests[0])
    assert d.digests[0] not in index.digests


def test_fail_worker_ends_its_pending_pages(ledger):
    """A worker that died (reaped: it writes nothing any more): its pages end
    at once and free their slots."""
    op = make_op(ledger, READ, [0, 1, 2, 3], worker_of=[0, 1, 0, 1])
    ledger.admit(op, 0)
    ledger.apply(op, 1, st.OK, 0, 0, 1)
    slots = ledger.fail_worker(1, 2)
    assert slots.tolist() == [3]
    assert [st.NAMES[c] for c in op.page_status] == ["pending", "ok", "pending", "worker_died"]
    ledger.apply(op, 0, st.OK, 0, 0, 3)
    ledger.apply(op, 2, st.OK, 0, 0, 3)
    assert op.done and len(ledger) == 0 and ledger.fenced_pages == 0
    ledger.check_free(slots)


def test_a_fence_holds_the_slots_and_the_op_until_the_worker_is_gone(ledger):
    """A killed stuck worker may still write its slots: its pages' status is
    final at once, but op.done (the slots may be reused) waits for unfence."""
    op = make_op(ledger, READ, [0, 1, 2, 3], worker_of=[0, 1, 0, 1])
    other = make_op(ledger, WRITE, [4, 5], worker_of=[1, 1])
    ledger.admit(op, 0)
    ledger.admit(other, 0)
    key = object()  # the killed worker's handle
    slots = ledger.fail_worker(1, 2, fence=key)
    assert sorted(slots.tolist()) == [1, 3, 4, 5]
    assert [st.NAMES[c] for c in op.page_status] == ["pending", "worker_died", "pending",
                                                     "worker_died"]
    assert other.status_counts() == {"worker_died": 2}
    assert ledger.fenced_pages == 4
    ledger.apply(op, 0, st.OK, 0, 0, 3)
    ledger.apply(op, 2, st.OK, 0, 0, 3)
    ledger.apply(op, 1, st.OK, 0, 0, 3)  # a late echo of a failed page changes nothing
    assert op.page_status[1] == st.WORKER_DIED
    assert not op.done and not other.done and len(ledger) == 2
    assert op.status == "running"
    for slot in slots.tolist():
        with pytest.raises(ValueError):
            ledger.check_free(np.array([slot]))  # fenced until the killed worker is reaped
    assert ledger.unfence(object(), 4) == 0  # another worker's fence: nothing
    assert ledger.unfence(key, 5) == 4
    assert op.done and other.done and len(ledger) == 0 and ledger.fenced_pages == 0
    assert op.status == "partial" and other.status == "failed"
    ledger.check_free(np.arange(6))
    assert not ledger.pins.any()


def test_unfence_all_ends_every_held_op(ledger):
    op = make_op(ledger, READ, [0, 1], worker_of=[0, 1])
    ledger.admit(op, 0)
    ledger.fail_worker(0, 1, fence="a")
    ledger.fail_worker(1, 1, fence="b")
    assert not op.done and ledger.fenced_pages == 2
    assert ledger.unfence_all(2) == 2
    assert op.done and op.status == "failed" and len(ledger) == 0


def test_may_finish_waits_for_an_ops_last_page(ledger):
    assert ledger.may_finish(lambda: 0, 8)  # nothing in flight: drain
    op = make_op(ledger, READ, range(4))
    ledger.admit(op, 0)
    assert not ledger.may_finish(lambda: 3, 8)  # 3 of its 4 pages pushed
    assert ledger.may_finish(lambda: 4, 8)
    assert ledger.may_finish(lambda: 2, 2)  # half a ring: a worker may be waiting
