"""Engine API: input checks, cancel, policies, metrics and lifecycle, as a caller sees them."""
import contextlib
import os
import signal
import stat
import time

import numpy as np
import pytest

from shm.names import list_ours
from workers import status as st

from helpers import engine, fill, random_pages


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    """One engine for the input checks: each one must leave it untouched (no op,
    no page at a worker), which every case asserts, so they can share it."""
    with engine(str(tmp_path_factory.mktemp("api")), pages=16) as e:
        yield e


@pytest.mark.parametrize("keys,pages,match", [
    (["a", "b"], [0], "2 keys but 1 host pages"),
    (["a"], [16], "out of range"),
    (["a"], [-1], "out of range"),
    (["a", "b"], [3, 3], "repeat"),
    (["a"], [1.5], "ints"),
    (["a/b"], [0], "contains"),
    (["../x"], [0], "contains"),
    (["a\0"], [0], "contains"),
    ([""], [0], "empty key"),
    ([None], [0], "str or bytes"),
    ([f"k{i}" for i in range(17)], list(range(17)), "exceeds the host pool"),
])
def test_bad_input_raises_before_reaching_a_worker(eng, keys, pages, match):
    with pytest.raises(ValueError, match=match):
        eng.prefetch(keys, pages)
    with pytest.raises(ValueError, match=match):
        eng.backup(keys, pages)
    m = eng.metrics()
    assert m["ops_in_flight"] == 0 and sum(m["worker_pages"]) == 0  # nothing reached a worker


@contextlib.contextmanager
def stopped_worker(e):
    """The engine's one worker SIGSTOPped (and seen stopped) for the block: an op
    submitted inside stays in flight until the block ends, however fast the
    store, so a check of "while in flight" never depends on a race. Far below
    the stall timeout (30 s), so the engine does not judge the worker stuck."""
    (pid,) = e.worker_pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while not _stopped(pid):
            assert time.monotonic() < deadline, "the worker never stopped"
            time.sleep(0.001)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in "Tt"


def test_slots_of_an_op_in_flight_are_refused(store):
    with engine(store, pages=8, workers=1) as e:
        fill(e, range(4), random_pages(e.geometry, 4))
        with stopped_worker(e):
            op = e.backup(["a", "b", "c", "d"], [0, 1, 2, 3])
            assert not op.done  # held by the stopped worker: the refusal below always runs
            with pytest.raises(ValueError, match="in flight"):
                e.prefetch(["z"], [2])
            with pytest.raises(ValueError, match="in flight"):
                e.backup(["z"], [3])
            assert e.metrics()["ops_in_flight"] == 1  # the refused calls made no op
        assert e.wait(op, 30) and op.status == "ok"
        assert e.wait(e.prefetch(["a"], [2]), 30)  # free again once done


def test_cancel_freezes_progress_and_frees_slots(store):
    with engine(store, pages=64, workers=1) as e:
        fill(e, range(32), random_pages(e.geometry, 32))
        keys = [f"c{i}" for i in range(32)]
        assert e.wait(e.backup(keys, range(32)), 30)
        op = e.prefetch(keys, range(32, 64))
        e.cancel(op)
        frozen = op.completed_pages
        assert e.wait(op, 30)
        assert op.status == "cancelled" and op.completed_pages == frozen
        counts = op.status_counts()
        assert counts.get("ok", 0) + counts.get("cancelled", 0) == 32
        assert e.wait(e.prefetch(keys, range(32, 64)), 30)  # slots reusable


def test_policies(store):
    """Each policy's answer to "may the scheduler stop waiting?" while the op is
    in flight (held there by a stopped worker) and once it is done."""
    with engine(store, pages=8, workers=1) as e:
        with stopped_worker(e):
            best = e.prefetch(["nope"], [0], policy="best_effort")
            waiting = e.prefetch(["nope"], [1], policy="wait_complete")
            timed = e.prefetch(["nope"], [2], policy="timeout", timeout_s=0.0)
            patient = e.prefetch(["nope"], [3], policy="timeout", timeout_s=60.0)
            assert not any(op.done for op in (best, waiting, timed, patient))
            assert best.ready() and timed.ready()  # at once / past its deadline
            assert not waiting.ready() and not patient.ready()
        for op in (best, waiting, timed, patient):
            assert e.wait(op, 30)
            assert op.ready() and op.status_counts() == {"miss": 1}
        with pytest.raises(ValueError):
            from hicache_mp import EngineConfig
            EngineConfig(storage_dir=store, prefetch_policy="sometimes")


def test_metrics_count_bytes_and_statuses(store):
    with engine(store, pages=8) as e:
        fill(e, range(4), random_pages(e.geometry, 4))
        e.wait(e.backup(list("abcd"), range(4)), 30)
        e.wait(e.prefetch(list("abcx"), range(4, 8)), 30)
        m = e.metrics()
        pb = e.geometry.page_bytes
        assert m["write_bytes"] == 4 * pb and m["read_bytes"] == 3 * pb
        assert m["read_status"] == {"ok": 3, "miss": 1} and m["misses"] == 1
        assert m["read_gbps"] > 0 and m["write_gbps"] > 0
        assert sum(m["worker_pages"]) == 8 and len(m["worker_busy"]) == 2
        assert m["ring_depth"] == [0, 0] and m["respawns"] == 0


def test_segments_and_store_are_owner_only(store):
    with engine(store, pages=4) as e:
        names = [n for n in list_ours() if e.tag in n]
        assert any(n.endswith(".pool") for n in names)
        for n in names:
            assert stat.S_IMODE(os.stat(os.path.join("/dev/shm", n)).st_mode) == 0o600, n
        fill(e, [0], random_pages(e.geometry, 1))
        e.wait(e.backup(["p"], [0]), 30)
        for d, dirs, files in os.walk(store):
            for x in dirs:
                assert stat.S_IMODE(os.stat(os.path.join(d, x)).st_mode) == 0o700
            for x in files:
                assert stat.S_IMODE(os.stat(os.path.join(d, x)).st_mode) == 0o600
    assert not [n for n in list_ours() if e.tag in n]


def test_closed_engine_refuses_work_and_close_is_idempotent(store):
    e = engine(store, pages=4)
    e.close()
    e.close()
    with pytest.raises(RuntimeError, match="closed"):
        e.prefetch(["a"], [0])


def test_exception_inside_with_block_still_cleans_up(store):
    with pytest.raises(ZeroDivisionError):
        with engine(store, pages=4) as e:
            tag = e.tag
            1 / 0
    assert not [n for n in list_ours() if tag in n]


def test_pinned_workers_keep_off_the_scheduler_core_and_leave_its_affinity(store):
    import psutil
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs at least 2 CPUs")
    with engine(store, pages=4, workers=2, pin_workers=True) as e:
        assert os.sched_getaffinity(0) == before  # threads started later keep every CPU
        for pid in e.worker_pids():
            cpus = set(psutil.Process(pid).cpu_affinity())
            assert len(cpus) == 1 and cpus < before
        fill(e, [0], random_pages(e.geometry, 1))
        assert e.wait(e.backup(["pin"], [0]), 30)
