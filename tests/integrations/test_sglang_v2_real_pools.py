"""The v2 differential test again, on SGLang 0.5.23's REAL host pools.

MambaPoolHost, MHATokenToKVPoolHost (KV and SWA), MLATokenToKVPoolHost (a
DeepSeek V4 compressed pool) and DSAIndexerPoolHost, built on CPU with
SGLang's shm allocator (hicache_mp/bench/sglang/real_hybrid.py; its docstring says what must be
installed: .ci/sglang-stack-requirements.txt, no torchvision). Skipped, naming
the missing module, where the pool classes cannot be imported.
"""
import os

import pytest
import torch

from hicache_mp.bench.sglang import real_hybrid as real  # noqa: E402

from hybrid_stack import load_or_skip  # noqa: E402

S = load_or_skip()

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402

from hicache_mp.integrations.sglang import sidecar_layouts  # noqa: E402
from test_sglang_v2 import (assert_same_hits, make, page_bytes, queries, write_scenario,  # noqa: E402,F401
                            kv_t, mamba_t, tok_t, keys_for, TRAIL)


class RealStack:
    """One rank's real host pools: KV (MHA), Mamba, SWA (MHA), DSA indexer, C4 (MLA)."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.kv = real.mha_pool(S, layout="layer_first")
        self.mamba = real.mamba_pool(S)
        self.swa = real.mha_pool(S, layout="page_first")
        self.anchor = real.mla_pool(S, layout="page_first")
        self.indexer = real.dsa_indexer_pool(S, self.anchor)
        self.c4 = real.mla_pool(S, layout="layer_first")
        for pool, _ in self.entries():
            real.fill_random(pool, g)

    def entries(self):
        return [(self.kv, PoolName.KV), (self.mamba, PoolName.MAMBA), (self.swa, PoolName.SWA),
                (self.indexer, PoolName.INDEXER), (self.c4, PoolName.DEEPSEEK_V4_C4)]


@pytest.mark.parametrize("build", [
    lambda: real.mamba_pool(S), lambda: real.mamba_pool(S, layout="page_first_direct"),
    lambda: real.mha_pool(S, layout="layer_first"), lambda: real.mha_pool(S, layout="page_first"),
    lambda: real.mha_pool(S, layout="page_first_direct"),
    lambda: real.mha_pool(S, layout="page_head"),
    lambda: real.mla_pool(S, layout="layer_first"), lambda: real.mla_pool(S, layout="page_first"),
    lambda: real.mla_pool(S, layout="page_first_direct"),
    lambda: real.dsa_indexer_pool(S, real.mla_pool(S, layout="page_first")),
    lambda: real.dsa_indexer_pool(S, real.mla_pool(S, layout="layer_first")),
], ids=["mamba", "mamba_direct", "mha_lf", "mha_pf", "mha_pfd", "mha_ph", "mla_lf", "mla_pf",
        "mla_pfd", "dsa_pf", "dsa_lf"])
def test_batched_copies_are_sglangs_own_pages(build):
    pool = build()
    real.fill_random(pool, torch.Generator().manual_seed(3))
    layout = sidecar_layouts.plan(pool)
    assert layout.batched, layout.describe()
    P = pool.page_size
    index = torch.tensor([5, 0, 3]) * P
    out = torch.zeros(3, layout.page_bytes, dtype=torch.uint8)
    layout.gather(index, out)
    for i, idx in enumerate(index.tolist()):
        assert torch.equal(out[i], page_bytes(pool, idx)), i
    dst = torch.tensor([1, 2, 4]) * P
    layout.scatter(dst, out)
    for i in range(3):
        assert torch.equal(page_bytes(pool, int(dst[i])), out[i]), i
        # and SGLang's own restore of the same bytes gives the same pool bytes
        pool.set_from_flat_data_page(int(dst[i]), pool.get_data_page(int(index[i])))
        assert torch.equal(page_bytes(pool, int(dst[i])), out[i]), i


def test_same_answers_and_bytes_as_file_on_real_pools(make, tmp_path):  # noqa: F811
    keys = keys_for(8)
    src_f, src_m = RealStack(0), RealStack(0)
    fb = make("file", src_f, store_dir=str(tmp_path / "file"))
    mb = make("mp", src_m, store_dir=str(tmp_path / "mp"))
    assert write_scenario(fb, src_f, keys) == write_scenario(mb, src_m, keys)
    assert_same_hits(fb, mb, queries(src_m, keys))
    dst_f, dst_m = RealStack(5), RealStack(5)
    fb2 = make("file", dst_f, store_dir=str(tmp_path / "file"))
    mb2 = make("mp", dst_m, store_dir=str(tmp_path / "mp"))
    into = [6, 7, 8, 9, 10, 11]

    def reads(b, s):
        return (b.batch_get_v2([kv_t(s, keys[:6], into)]),
                b.batch_get_v2([tok_t(PoolName.INDEXER, s.indexer, keys[:6], into),
                                mamba_t(s, keys[4:5], [3]),
                                tok_t(PoolName.SWA, s.swa, keys[2:4], into[:2], TRAIL),
                                tok_t(PoolName.DEEPSEEK_V4_C4, s.c4, keys[:3], into[:3])]))

    got = reads(mb2, dst_m)
    assert got == reads(fb2, dst_f)
    kv, side = got
    assert kv == {PoolName.KV: [True] * 6}
    assert side == {PoolName.INDEXER: [True] * 6, PoolName.MAMBA: [True], PoolName.SWA: [True] * 2,
                    PoolName.DEEPSEEK_V4_C4: [False] * 3}   # never written
    for name in ("kv", "swa", "indexer", "c4"):
        pool_f, pool_m = getattr(dst_f, name), getattr(dst_m, name)
        for z in into:
            assert torch.equal(page_bytes(pool_f, z * pool_f.page_size),
                               page_bytes(pool_m, z * pool_m.page_size)), (name, z)
    for slot in range(6):
        assert torch.equal(page_bytes(dst_f.mamba, slot), page_bytes(dst_m.mamba, slot))
    pools = mb2.metrics()["sidecar_pools"]
    assert all(p["batched"] for p in pools.values())
    # every real pool on the shm allocator is served zero-copy: the indexer
    # (page_first: one run per page), Mamba (temporal, conv: two), SWA (MHA
    # page_first, token-major: K and V) and C4 (MLA layer_first: one per layer)
    assert {n: (p["zero_copy"], p["parts"]) for n, p in pools.items()} == {
        "mamba": (True, 2), "swa": (True, 2), "indexer": (True, 1),
        "deepseek_v4_c4": (True, 2)}


class OnePool:
    """A real KV pool and one real sidecar pool built by `build`."""

    def __init__(self, build, name, seed):
        self.kv, self.pool, self.name = real.mha_pool(S, layout="layer_first"), build(), name
        g = torch.Generator().manual_seed(seed)
        real.fill_random(self.kv, g)
        real.fill_random(self.pool, g)

    def entries(self):
        return [(self.kv, PoolName.KV), (self.pool, self.name)]


@pytest.mark.parametrize("build,name,parts", [
    (lambda: real.mha_pool(S, layout="layer_first"), PoolName.SWA, 4),
    (lambda: real.mha_pool(S, layout="page_first"), PoolName.SWA, 2),
    (lambda: real.mha_pool(S, layout="page_first_direct"), PoolName.SWA, 2),
    (lambda: real.mha_pool(S, layout="page_head"), PoolName.SWA, 2),
    (lambda: real.mla_pool(S, layout="layer_first"), PoolName.DEEPSEEK_V4_C4, 2),
    (lambda: real.mla_pool(S, layout="page_first"), PoolName.DEEPSEEK_V4_C4, 1),
    (lambda: real.mla_pool(S, layout="page_first_direct"), PoolName.DEEPSEEK_V4_C4, 1),
    (lambda: real.dsa_indexer_pool(S, real.mla_pool(S, layout="page_first")),
     PoolName.INDEXER, 1),
    (lambda: real.dsa_indexer_pool(S, real.mla_pool(S, layout="layer_first")),
     PoolName.INDEXER, 2),
], ids=["mha_lf", "mha_pf", "mha_pfd", "mha_ph", "mla_lf", "mla_pf", "mla_pfd", "dsa_pf",
        "dsa_lf"])
def test_every_layout_is_zero_copy_and_reads_staged_pages(make, tmp_path, build, name,  # noqa: F811
                                                         parts):
    """Under the shm allocator every batched layout is mapped in place, as
    `parts` runs per page; a page written staged reads zero-copy byte for byte,
    and back, into other pages of other pools."""
    store = str(tmp_path / "s")
    a, b, c = OnePool(build, name, 1), OnePool(build, name, 2), OnePool(build, name, 3)
    staged = make("mp", a, store_dir=store, zero_copy=False)
    direct = make("mp", b, store_dir=store)
    assert staged.metrics()["sidecar_pools"][name.value]["zero_copy"] is False
    m = direct.metrics()["sidecar_pools"][name.value]
    assert (m["zero_copy"], m["parts"]) == (True, parts), m
    P = a.pool.page_size

    def t(stack, keys, pages):
        return tok_t(name, stack.pool, keys, pages)

    k1 = keys_for(3, "staged")
    assert staged.batch_set_v2([t(a, k1, [1, 2, 3])]) == {name: [True] * 3}
    untouched = page_bytes(b.pool, 4 * P)
    assert direct.batch_get_v2([t(b, k1, [5, 6, 7])]) == {name: [True] * 3}
    for x, z in zip([1, 2, 3], [5, 6, 7]):
        assert torch.equal(page_bytes(b.pool, z * P), page_bytes(a.pool, x * P)), (x, z)
    assert torch.equal(page_bytes(b.pool, 4 * P), untouched)
    k2 = keys_for(2, "direct")
    assert direct.batch_set_v2([t(b, k2, [2, 3])]) == {name: [True] * 2}
    staged_c = make("mp", c, store_dir=store, zero_copy=False)
    assert staged_c.batch_get_v2([t(c, k2, [6, 1])]) == {name: [True] * 2}
    assert torch.equal(page_bytes(c.pool, 6 * P), page_bytes(b.pool, 2 * P))
    assert torch.equal(page_bytes(c.pool, 1 * P), page_bytes(b.pool, 3 * P))
