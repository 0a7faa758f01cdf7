"""The `fast_file` replica (SGLang PR #39880's I/O paths) moves the exact bytes.

Real threads, a real store on disk, real shared-memory pools; the other
backends read what it writes and it reads what they write, in every layout
(page-first ones go by readv straight into the pool, layer_first staged),
with one and several read/write threads, and ops longer than one
128-page controller batch.
"""
import os
import random
import threading

import pytest
import torch

from hicache_mp import EngineConfig, make_engine
from hicache_mp.bench.fast_file import STORAGE_BATCH_SIZE, FastFileEngine
from helpers import engine, fill, geometry, random_pages, read_back
from workers import naming

LAYOUTS = ["page_first", "page_first_direct", "layer_first"]


def fast_file(store, layout="page_first", pages=64, read_workers=1, write_workers=1):
    return make_engine("fast_file", EngineConfig(storage_dir=store, host_pool_pages=pages),
                       geometry(layout), read_workers=read_workers, write_workers=write_workers)


def _files(store, mark):
    return [f for _, _, fs in os.walk(store) for f in fs if mark in f]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("workers", [1, 3])
def test_fast_file_write_then_read_back_across_batches(store, layout, workers):
    n = STORAGE_BATCH_SIZE + 20           # two controller batches, the second short
    keys = [f"ff-{i}" for i in range(n)]
    with fast_file(store, layout, pages=2 * n, read_workers=workers, write_workers=workers) as eng:
        data = random_pages(eng.geometry, n, seed=5)
        slots = random.Random(2).sample(range(2 * n), n)
        fill(eng, slots, data)
        op = eng.backup(keys, slots)
        assert eng.wait(op, 60) and op.status == "ok" and op.completed_pages == n
        eng.host_pool.tensor.fill_(3)     # poison: only a real read brings the bytes back
        back = random.Random(3).sample(range(2 * n), n)
        op = eng.prefetch(keys, back)
        assert eng.wait(op, 60) and op.status == "ok" and op.completed_pages == n
        assert torch.equal(read_back(eng, back).view(torch.int16), data.view(torch.int16))
        assert eng.metrics()["read_bytes"] == n * eng.geometry.page_bytes
    assert _files(store, naming.TMP_MARK) == []   # every write published by os.replace
    assert len(_files(store, naming.PAGE_SUFFIX)) == n


@pytest.mark.parametrize("writer,reader", [("mp", "fast_file"), ("fast_file", "mp"),
                                           ("fast_file", "file")])
def test_fast_file_shares_the_store_format(store, writer, reader):
    keys = [f"shared-{i}" for i in range(6)]
    make = (lambda layout: fast_file(store, layout, pages=8)) if writer == "fast_file" else \
        (lambda layout: engine(store, layout, backend=writer, pages=8))
    with make("page_first") as eng:
        data = random_pages(eng.geometry, 6, seed=7)
        fill(eng, range(6), data)
        assert eng.wait(eng.backup(keys, range(6)), 30)
    make = (lambda layout: fast_file(store, layout, pages=8)) if reader == "fast_file" else \
        (lambda layout: engine(store, layout, backend=reader, pages=8))
    with make("layer_first") as eng:
        op = eng.prefetch(keys, [7, 6, 5, 4, 3, 2])
        assert eng.wait(op, 30) and op.status == "ok"
        assert torch.equal(read_back(eng, [7, 6, 5, 4, 3, 2]).view(torch.int16),
                           data.view(torch.int16))


def test_fast_file_missing_and_damaged_pages_end_the_leading_run(store):
    keys = [f"k{i}" for i in range(8)]
    with fast_file(store, pages=16, read_workers=2) as eng:
        data = random_pages(eng.geometry, 8, seed=3)
        fill(eng, range(8), data)
        present = [0, 1, 2, 4, 5, 6, 7]  # k3 never written
        assert eng.wait(eng.backup([keys[i] for i in present], present), 30)
        eng.host_pool.tensor.fill_(5)
        # The hit query stops at k3, as SGLang's does: k4-k7 are never read.
        op = eng.prefetch(keys, range(8, 16))
        assert eng.wait(op, 30)
        assert op.status == "partial" and op.completed_pages == 3
        assert op.status_counts() == {"ok": 3, "miss": 1, "cancelled": 4}
        assert torch.equal(read_back(eng, range(8, 11)).view(torch.int16),
                           data[:3].view(torch.int16))
        assert eng.exists(keys[4:]) == 4   # pages not read are still known present
        victim = naming.page_path(store, naming.key_digest(keys[5], eng.namespace))
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 1)
        op = eng.prefetch(keys[4:], range(8, 12))
        assert eng.wait(op, 30)
        assert op.completed_pages == 1 and op.status_counts() == {"ok": 3, "corrupt": 1}


def test_fast_file_rewrite_of_a_present_page_is_skipped(store):
    with fast_file(store, pages=4) as eng:
        fill(eng, [0], random_pages(eng.geometry, 1, seed=1))
        assert eng.wait(eng.backup(["p"], [0]), 30)
        path = naming.page_path(store, naming.key_digest("p", eng.namespace))
        before = os.stat(path).st_ino
        fill(eng, [1], random_pages(eng.geometry, 1, seed=2))
        op = eng.backup(["p"], [1])
        assert eng.wait(op, 30) and op.status == "ok"
        assert os.stat(path).st_ino == before   # same size: the PR skips, never replaces


@pytest.mark.parametrize("kw", [{"read_workers": 0}, {"write_workers": -1},
                                {"read_workers": 1.5}, {"read_workers": True}])
def test_fast_file_bad_worker_counts_fail_before_any_thread(store, kw):
    before = threading.active_count()
    with pytest.raises(ValueError, match="workers"):
        FastFileEngine(EngineConfig(storage_dir=store, host_pool_pages=4), geometry(), **kw)
    assert threading.active_count() == before


def test_fast_file_close_joins_its_threads(store):
    before = {t.ident for t in threading.enumerate()}
    with fast_file(store, pages=8, read_workers=3, write_workers=2) as eng:
        fill(eng, range(8), random_pages(eng.geometry, 8))
        eng.wait(eng.backup([f"c{i}" for i in range(8)], range(8)), 30)
    left = [t.name for t in threading.enumerate() if t.ident not in before]
    assert left == []
