"""Bad input from callers raises ValueError before anything reaches a worker.

tests/test_engine_api.py covers the common cases (lengths, ranges, duplicate
slots, '/', '..', NUL, empty and non-str keys, an op larger than the pool).
Here: what it leaves out. Absurd sizes, a single string passed as the key
list, an unknown policy, unsigned indices that would wrap, and a slot that an
op still in flight holds (made deterministic by freezing the worker).
"""
import os
import signal

import numpy as np
import pytest

from hicache_mp import EngineConfig, PageGeometry
from shm.names import list_ours, owner_pid

from faultkit import TINY, make, put


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    with make(str(tmp_path_factory.mktemp("input")), pages=8, workers=1) as e:
        yield e


def _nothing_reached_a_worker(e):
    m = e.metrics()
    assert m["ops_in_flight"] == 0 and m["pages_in_flight"] == 0
    assert sum(m["worker_pages"]) == 0


@pytest.mark.parametrize("keys,pages,kw,match", [
    ("ab", [0, 1], {}, "single str"),                             # not two keys "a", "b"
    (b"ab", [0, 1], {}, "single str"),
    (["a"], np.array([2**64 - 1], dtype=np.uint64), {}, "out of range"),
    (["a"], [2**70], {}, "ints"),
    (["a"], [True], {}, "ints"),
    (["a"], [[0]], {}, "1-D"),
    (["a"], 0, {}, "1-D"),
    (["x" * 4097], [0], {}, "longer than"),
    ([b"a\\b"], [0], {}, "contains"),
    (["a", "b"], [0, 8], {}, "out of range"),
    (["a"], [0], {"policy": "sometimes"}, "policy"),
])
def test_more_bad_input(eng, keys, pages, kw, match):
    with pytest.raises(ValueError, match=match):
        eng.prefetch(keys, pages, **kw)
    if not kw:
        with pytest.raises(ValueError, match=match):
            eng.backup(keys, pages)
    _nothing_reached_a_worker(eng)


def test_slot_held_by_an_op_in_flight_is_refused(store):
    with make(store, pages=8, workers=1) as e:
        put(e, 0, b"\0" * e.geometry.page_bytes)
        worker = e.worker_pids()[0]
        os.kill(worker, signal.SIGSTOP)  # the op cannot finish while we probe
        try:
            op = e.backup(["a", "b"], [0, 1])
            for keys, pages in ((["z"], [1]), (["y", "z"], [5, 0])):
                with pytest.raises(ValueError, match="in flight"):
                    e.prefetch(keys, pages)
                with pytest.raises(ValueError, match="in flight"):
                    e.backup(keys, pages)
        finally:
            os.kill(worker, signal.SIGCONT)
        assert e.wait(op, 30) and op.status == "ok"
        assert e.wait(e.prefetch(["a"], [1]), 30)  # free again once done


@pytest.mark.parametrize("cfg,match", [
    (dict(num_workers=10**6), "num_workers"),
    (dict(num_workers=-1), "num_workers"),
    (dict(host_pool_pages=True), "host_pool_pages"),
    (dict(host_pool_pages=0), "host_pool_pages"),
    (dict(ring_capacity=2**40), "ring_capacity"),
    (dict(prefetch_timeout_s=-1.0), "prefetch_timeout_s"),
    (dict(rescan_interval_s=float("nan")), "rescan_interval_s"),
])
def test_absurd_config_is_refused(store, cfg, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(storage_dir=store, **cfg)


@pytest.mark.parametrize("pages,geo", [
    (10**12, TINY),                                                # a petabyte pool
    (1024, dict(TINY, num_layers=10**6, head_dim=10**4)),          # pages of ~1 TB
])
def test_pool_larger_than_shared_memory_is_refused_before_anything_starts(store, pages, geo):
    mine = lambda: {n for n in list_ours() if owner_pid(n) == os.getpid()}  # noqa: E731
    before = mine()
    with pytest.raises(ValueError, match="does not fit"):
        make(store, geo=geo, pages=pages, workers=1)
    assert mine() <= before  # no segment was created, no worker started


def test_absurd_geometry_is_refused():
    for bad in (dict(num_layers=0), dict(head_dim=-1), dict(page_size=1.5), dict(dtype="int3")):
        with pytest.raises(ValueError):
            PageGeometry(**{**TINY, **bad})


def test_segment_larger_than_dev_shm_is_refused():
    """The shm layer's own check, for a pool that fits in memory but not in /dev/shm."""
    from shm import HostPool, new_owner_tag
    g = PageGeometry(**TINY)
    vfs = os.statvfs("/dev/shm")
    pages = vfs.f_bavail * vfs.f_frsize // g.page_bytes + 1
    with pytest.raises(ValueError, match="does not fit in /dev/shm"):
        HostPool(g, pages, name=new_owner_tag() + ".pool", create=True)
