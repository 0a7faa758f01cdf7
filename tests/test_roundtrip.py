"""Backup, close, reopen, prefetch: the exact bytes come back, across layouts and backends."""
import os
import random

import numpy as np
import pytest
import torch

from helpers import engine, fill, random_pages, read_back

LAYOUTS = ["page_first", "layer_first"]


@pytest.mark.parametrize("write_layout", LAYOUTS)
@pytest.mark.parametrize("read_layout", LAYOUTS)
def test_backup_then_prefetch_in_new_engine(store, write_layout, read_layout):
    n = 24
    keys = [os.urandom(32).hex() for _ in range(n)]
    with engine(store, write_layout, pages=48, workers=3) as eng:
        data = random_pages(eng.geometry, n, seed=1)
        slots = random.Random(0).sample(range(48), n)
        fill(eng, slots, data)
        op = eng.backup(keys, slots)
        assert eng.wait(op, 30), op
        assert op.status == "ok" and op.completed_pages == n
        assert eng.exists(keys) == n
    with engine(store, read_layout, pages=48, workers=2) as eng:   # new processes, new index
        assert eng.exists(keys) == n
        eng.host_pool.tensor.fill_(7)  # poison every slot first
        slots = random.Random(1).sample(range(48), n)
        op = eng.prefetch(keys, slots)
        assert eng.wait(op, 30), op
        assert op.status == "ok" and op.completed_pages == n
        got = read_back(eng, slots)
        assert torch.equal(got.view(torch.int16), data.view(torch.int16))


@pytest.mark.parametrize("writer,reader", [("mp", "file"), ("file", "mp")])
def test_baseline_and_mp_share_one_format(store, writer, reader):
    keys = [f"page-{i}" for i in range(6)]
    with engine(store, backend=writer, pages=8) as eng:
        data = random_pages(eng.geometry, 6, seed=2)
        fill(eng, range(6), data)
        assert eng.wait(eng.backup(keys, range(6)), 30)
    with engine(store, "layer_first", backend=reader, pages=8) as eng:
        op = eng.prefetch(keys, [7, 6, 5, 4, 3, 2])
        assert eng.wait(op, 30) and op.status == "ok"
        assert torch.equal(read_back(eng, [7, 6, 5, 4, 3, 2]).view(torch.int16), data.view(torch.int16))


def test_missing_page_in_the_middle_gives_leading_pages_only(store):
    keys = [f"k{i}" for i in range(8)]
    with engine(store, pages=16) as eng:
        data = random_pages(eng.geometry, 8, seed=3)
        fill(eng, range(8), data)
        present = [0, 1, 2, 4, 5, 6, 7]  # k3 never written
        assert eng.wait(eng.backup([keys[i] for i in present], present), 30)
        assert eng.exists(keys) == 3
        op = eng.prefetch(keys, range(8, 16))
        assert eng.wait(op, 30)
        assert op.status == "partial" and op.completed_pages == 3
        assert op.status_counts() == {"ok": 7, "miss": 1}
        assert torch.equal(read_back(eng, range(8, 11)).view(torch.int16), data[:3].view(torch.int16))
        assert eng.metrics()["misses"] == 1


def test_nothing_in_store_fails_cleanly(store):
    with engine(store, pages=4) as eng:
        op = eng.prefetch(["a", "b"], [0, 1])
        assert eng.wait(op, 30)
        assert op.status == "failed" and op.completed_pages == 0
        # slots are free again: the next op on the same slots is accepted
        assert eng.wait(eng.prefetch(["a"], [0]), 30)


def test_checksums_on_catch_a_flipped_payload_byte(store):
    with engine(store, pages=4, write_checksum=True) as eng:
        fill(eng, [0], random_pages(eng.geometry, 1))
        assert eng.wait(eng.backup(["x"], [0]), 30)
        path = next(os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs if f.endswith(".page"))
        with open(path, "r+b") as f:
            f.seek(4096 + 100)
            b = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        op = eng.prefetch(["x"], [1])
        assert eng.wait(op, 30)
        assert op.status == "failed" and op.status_counts() == {"corrupt": 1}
