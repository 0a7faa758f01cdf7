"""Hybrid pools on a host without an accelerator: SGLang's real Mamba, SWA and
DSA indexer host pools, served zero-copy and staged, byte for byte.

SGLang 0.5.23's servers build every host pool with its constructor default
`pin_memory=True`, and the pools' own `get_dummy_flat_data_page` allocates
with it; CPU torch refuses pinned memory ("pin_memory=True requires a CUDA or
other accelerator backend"). A backend that asks the pool for that page sees
the error and every hybrid prefix misses. The pools here are SGLang's own
classes (hicache_mp/bench/sglang/real_hybrid.py), their memory allocated unpinned (CPU
torch cannot register host memory either) and then flagged as a server's are.
"""
import pytest
import torch

from hicache_mp.bench.sglang import real_hybrid as real  # noqa: E402

from hybrid_stack import load_or_skip  # noqa: E402

S = load_or_skip()

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402

from hicache_mp.integrations.sglang import sidecar_layouts  # noqa: E402
from test_sglang_v2 import TRAIL, keys_for, make, mamba_t, page_bytes, tok_t  # noqa: E402,F401


def _torch_pins() -> bool:
    """Can torch allocate pinned host memory here (what SGLang's pools ask for)?"""
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True


NO_ACCELERATOR = not _torch_pins()


def pinned_like_a_server(pool):
    pool.pin_memory = True
    return pool


class CpuStack:
    """One rank: a real KV pool plus real Mamba, SWA and DSA indexer pools."""

    def __init__(self, seed, allocator):
        self.allocator = allocator
        g = torch.Generator().manual_seed(seed)
        self.kv = real.mha_pool(S, layout="layer_first")
        self.mamba = self._alloc(real.mamba_pool, S)
        self.swa = self._alloc(real.mha_pool, S, layout="page_first")
        self.anchor = real.mla_pool(S, layout="page_first")
        self.indexer = self._alloc(real.dsa_indexer_pool, S, self.anchor)
        for pool, _ in self.entries():
            pinned_like_a_server(pool)
            real.fill_random(pool, g)

    def _alloc(self, build, *a, **kw):
        """On `allocator` ("shm": memfds, zero-copy; "default": torch's, staged)."""
        return build(*a, allocator=self.allocator, **kw)

    def entries(self):
        return [(self.kv, PoolName.KV), (self.mamba, PoolName.MAMBA), (self.swa, PoolName.SWA),
                (self.indexer, PoolName.INDEXER)]


@pytest.mark.skipif(not NO_ACCELERATOR, reason="an accelerator pins host memory here")
def test_sglangs_own_dummy_page_fails_without_an_accelerator():
    """The failure the backend must route around, seen on SGLang's own pool."""
    pool = pinned_like_a_server(real.mamba_pool(S))
    with pytest.raises(RuntimeError, match="pin_memory"):
        pool.get_dummy_flat_data_page()
    d = sidecar_layouts.dummy_flat_page(pool)
    assert d.numel() * d.element_size() == pool.size_per_token * pool.page_size
    assert pool.pin_memory is True   # the pool itself is left as it was


@pytest.mark.parametrize("allocator,zero_copy", [("shm", True), ("shm", False),
                                                 ("default", None)],
                         ids=["zero_copy", "staged", "default_allocator"])
def test_hybrid_pools_are_served_on_cpu_byte_exact(make, tmp_path, allocator, zero_copy):  # noqa: F811
    store = str(tmp_path / "s")
    cfg = {} if zero_copy is None else {"zero_copy": zero_copy}
    src, dst = CpuStack(1, allocator), CpuStack(2, allocator)
    wb = make("mp", src, store_dir=store, **cfg)
    m = wb.metrics()
    assert m["sidecar_unserved"] == {}, m["sidecar_unserved"]
    want_zc = zero_copy is True
    assert {n: p["zero_copy"] for n, p in m["sidecar_pools"].items()} == \
        {"mamba": want_zc, "swa": want_zc, "indexer": want_zc}
    keys = keys_for(4, f"cpu-{allocator}-{zero_copy}")
    pages = [1, 2, 3, 4]
    writes = [mamba_t(src, keys[-1:], [2]),
              tok_t(PoolName.SWA, src.swa, keys[-2:], pages[-2:], TRAIL),
              tok_t(PoolName.INDEXER, src.indexer, keys, pages)]
    assert wb.batch_set_v2(writes) == {PoolName.MAMBA: [True], PoolName.SWA: [True] * 2,
                                       PoolName.INDEXER: [True] * 4}
    rb = make("mp", dst, store_dir=store, **cfg)
    into = [5, 6, 7, 8]
    untouched = page_bytes(dst.indexer, 9 * dst.indexer.page_size)
    got = rb.batch_get_v2([mamba_t(dst, keys[-1:], [4]),
                           tok_t(PoolName.SWA, dst.swa, keys[-2:], into[-2:], TRAIL),
                           tok_t(PoolName.INDEXER, dst.indexer, keys, into)])
    assert got == {PoolName.MAMBA: [True], PoolName.SWA: [True] * 2,
                   PoolName.INDEXER: [True] * 4}
    assert torch.equal(page_bytes(dst.mamba, 4), page_bytes(src.mamba, 2))
    for a, b in zip(pages[-2:], into[-2:]):
        P = src.swa.page_size
        assert torch.equal(page_bytes(dst.swa, b * P), page_bytes(src.swa, a * P)), (a, b)
    for a, b in zip(pages, into):
        P = src.indexer.page_size
        assert torch.equal(page_bytes(dst.indexer, b * P), page_bytes(src.indexer, a * P)), (a, b)
    assert torch.equal(page_bytes(dst.indexer, 9 * dst.indexer.page_size), untouched)
