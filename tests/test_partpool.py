"""PrefetchEngine over a pool of several regions (shm.partpool), as SGLang's
Mamba state is (one memfd per tensor): real memfds, real workers, real files.

A page is one run of each part, in part order; the file holds those runs back
to back, so an engine with its own (page_first) pool reads the same bytes.
"""
import mmap
import os

import numpy as np
import pytest

from hicache_mp import EngineConfig, PageGeometry
from hicache_mp.engine import PrefetchEngine
from workers import status as st

PAGES = 6
STRIDES = (96, 40, 8, 8)       # three regions; the last holds two parts (a K and a V half)
PAGE = sum(STRIDES)


class Regions:
    """Three memfds laid out like SGLang's shm allocator makes them."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        sizes = (PAGES * 96, PAGES * 40, PAGES * 16)
        self.fds, self.maps, self.arrays = [], [], []
        for n in sizes:
            fd = os.memfd_create("hicache_mp_test", os.MFD_CLOEXEC)
            os.ftruncate(fd, n)
            mm = mmap.mmap(fd, n)
            a = np.frombuffer(mm, dtype=np.uint8)
            a[:] = rng.integers(0, 256, n, dtype=np.uint8)
            self.fds.append(fd)
            self.maps.append(mm)
            self.arrays.append(a)

    def parts(self):
        a, b, c = self.fds
        return [(a, 0, 96), (b, 0, 40), (c, 0, 8), (c, PAGES * 8, 8)]

    def page(self, p) -> bytes:
        a, b, c = self.arrays
        return (a[p * 96:(p + 1) * 96].tobytes() + b[p * 40:(p + 1) * 40].tobytes()
                + c[p * 8:(p + 1) * 8].tobytes() + c[PAGES * 8 + p * 8:PAGES * 8 + (p + 1) * 8].tobytes())

    def close(self):
        self.arrays = []
        for mm in self.maps:
            mm.close()
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def regions():
    made = []

    def new(seed):
        r = Regions(seed)
        made.append(r)
        return r

    yield new
    for r in made:
        r.close()


def geometry():
    return PageGeometry(num_layers=1, num_kv_heads=1, head_dim=PAGE, page_size=1,
                        dtype="uint8", mla=True)


def config(store, pages=PAGES):
    return EngineConfig(storage_dir=store, num_workers=2, host_pool_pages=pages)


def test_pages_move_in_place_in_every_part_and_read_back_anywhere(store, regions):
    src, dst = regions(1), regions(2)
    keys = [f"k{i}" for i in range(3)]
    with PrefetchEngine(config(store), geometry(), pool_parts=src.parts()) as eng:
        op = eng.backup(keys, [1, 3, 5])
        assert eng.wait(op, 30) and (op.page_status == st.OK).all()
    before = [dst.page(p) for p in range(PAGES)]
    with PrefetchEngine(config(store), geometry(), pool_parts=dst.parts()) as eng:
        op = eng.prefetch(keys, [4, 0, 2], policy="wait_complete")
        assert eng.wait(op, 30) and op.completed_pages == 3
    for a, z in zip([1, 3, 5], [4, 0, 2]):
        assert dst.page(z) == src.page(a)
    for p in (1, 3, 5):   # nothing else in any region was touched
        assert dst.page(p) == before[p]
    # the file is the parts back to back: an engine with its own pool reads exactly that
    with PrefetchEngine(config(store), geometry()) as eng:
        op = eng.prefetch(keys, [0, 1, 2], policy="wait_complete")
        assert eng.wait(op, 30) and op.completed_pages == 3
        own = eng.host_pool.tensor.reshape(PAGES, PAGE)
        for a, slot in zip([1, 3, 5], [0, 1, 2]):
            assert own[slot].numpy().tobytes() == src.page(a)


def test_bad_parts_are_refused_before_any_worker_starts(store, regions):
    r = regions(3)
    a, b, c = r.fds
    with pytest.raises(ValueError, match="add up to"):
        PrefetchEngine(config(store), geometry(), pool_parts=r.parts()[:3])
    with pytest.raises(ValueError, match="holds .* bytes"):
        PrefetchEngine(config(store, pages=PAGES + 1), geometry(), pool_parts=r.parts())
    with pytest.raises(ValueError, match="not both"):
        PrefetchEngine(config(store), geometry(), pool_fd=a, pool_parts=r.parts())
    with pytest.raises(ValueError, match="stride must be positive"):
        PrefetchEngine(config(store), geometry(),
                       pool_parts=[(a, 0, 96), (b, 0, 40), (c, 0, 16), (c, 0, 0)])
    assert not os.listdir(store) or all(n.startswith(".") for n in os.listdir(store))
