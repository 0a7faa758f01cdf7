"""The v2 path keeps the GIL on SGLang's storage threads: no C call inside a
batch_get_v2 / batch_exists_v2 / batch_set_v2 lets it go, but the one sleep
of a batch (the wait for its pages, KV and sidecars together).

On SGLang's real host pools (KV, Mamba, SWA, DSA indexer; shm allocator,
zero-copy), through `released_in` (hicache_mp/bench/giltrace.py): a second thread
counts in pure Python while the switch interval is 1 s, so it runs only
while the call's thread has given the GIL up, and the C call during which it
moved is named. Under a busy scheduler each such release costs the storage
thread up to a switch interval (5 ms) to win the GIL back.
"""
import time

import torch

from hicache_mp.bench.sglang import real_hybrid as real  # noqa: E402

from hybrid_stack import load_or_skip  # noqa: E402

S = load_or_skip()

from hicache_mp.bench.giltrace import released_in  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402

from test_sglang_v2 import ALL, TRAIL, keys_for, make, page_bytes, tok_t  # noqa: E402,F401

ROUNDS = 3
PAGES = 6
# The tracer's switch interval: each release found costs the call about that
# long (the counter holds the GIL until it is forced to drop it), and the calls
# here take milliseconds. Within it a sidecar op still in flight when the KV
# op's wait returns is done, so a second sleep it would cost is not seen here:
# the H200 harness's tracer counts those (scripts/sglang_hybrid_check.py).
SWITCH_S = 0.5


class Stack:
    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.kv = real.mha_pool(S, layout="layer_first", tokens=64)
        self.mamba = real.mamba_pool(S, slots=8)
        self.swa = real.mha_pool(S, layout="page_first", tokens=64)
        self.anchor = real.mla_pool(S, layout="page_first", tokens=64)
        self.indexer = real.dsa_indexer_pool(S, self.anchor)
        for pool, _ in self.entries():
            real.fill_random(pool, g)

    def entries(self):
        return [(self.kv, PoolName.KV), (self.mamba, PoolName.MAMBA), (self.swa, PoolName.SWA),
                (self.indexer, PoolName.INDEXER)]


def transfers(s, keys, pages, slot):
    return [tok_t(PoolName.KV, s.kv, keys, pages),
            PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:],
                         host_indices=torch.tensor([slot], dtype=torch.int64), hit_policy=TRAIL),
            tok_t(PoolName.SWA, s.swa, keys[-2:], pages[-2:], TRAIL),
            tok_t(PoolName.INDEXER, s.indexer, keys, pages)]


def _at_wait(f):
    return f[0].startswith("wake.py:") and f[0].endswith(" wait")


def sleeps(found):
    """The wait's sleeps: the wake semaphore's blocking acquire (shm/wake.py)."""
    return [f for f in found if _at_wait(f) and "acquire" in f[1]]


def others(found):
    """Every other release (the tracer also names the acquire's line)."""
    return [f for f in found if not _at_wait(f)]


def test_v2_calls_let_the_gil_go_only_for_the_batchs_one_sleep(make, tmp_path):  # noqa: F811
    import gc
    gc.collect()
    gc.disable()   # a collection may free what lets the GIL go (a torch tensor): not the call's
    try:
        _rounds(make, tmp_path)
    finally:
        gc.enable()


def _rounds(make, tmp_path):  # noqa: F811
    store = str(tmp_path / "s")
    src, dst = Stack(1), Stack(2)
    wb = make("mp", src, store_dir=store)
    rb = make("mp", dst, store_dir=store)
    assert all(p["zero_copy"] for p in rb.metrics()["sidecar_pools"].values())
    mamba_q = PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=TRAIL)
    swa_q = PoolTransfer(name=PoolName.SWA, keys=["x", "y"], hit_policy=TRAIL)
    idx_q = PoolTransfer(name=PoolName.INDEXER, keys=None, hit_policy=ALL)
    # one batch first: a process's first wait finds libc (ctypes.util runs
    # ldconfig in a subprocess, shm/wake.py), once
    warm = keys_for(PAGES, "warm-")
    wb.batch_set_v2(transfers(src, warm, list(range(ROUNDS * PAGES, (ROUNDS + 1) * PAGES)), 7))
    for r in range(ROUNDS):
        keys = keys_for(PAGES, f"gil{r}-")
        pages = list(range(r * PAGES, (r + 1) * PAGES))
        out, found = released_in(wb.batch_set_v2, transfers(src, keys, pages, r), switch_s=SWITCH_S)
        assert all(all(v) for v in out.values()), out
        assert others(found) == [], found
        assert len(sleeps(found)) <= 1, found
        # the reader's index learns the pages from the store once (the
        # sidecars' answers come in without a wait: on a loaded box the first
        # query may miss); then the hit query over the whole key list asks nobody
        deadline = time.monotonic() + 10
        while rb.batch_exists_v2(keys, [mamba_q, swa_q, idx_q]).kv_hit_pages != PAGES:
            assert time.monotonic() < deadline, "the reader never learnt the writer's pages"
            time.sleep(0.01)
        hit, found = released_in(rb.batch_exists_v2, keys, [mamba_q, swa_q, idx_q],
                                 switch_s=SWITCH_S)
        assert hit.kv_hit_pages == PAGES and hit.restorable_prefix_pages[-1] == PAGES, hit
        assert found == [], found
        got, found = released_in(rb.batch_get_v2, transfers(dst, keys, pages, r), switch_s=SWITCH_S)
        assert all(all(v) for v in got.values()), got
        assert others(found) == [], found
        assert len(sleeps(found)) <= 1, found
        for p in pages:
            assert torch.equal(page_bytes(dst.kv, p * dst.kv.page_size),
                               page_bytes(src.kv, p * src.kv.page_size))
            assert torch.equal(page_bytes(dst.indexer, p * dst.indexer.page_size),
                               page_bytes(src.indexer, p * src.indexer.page_size))
        assert torch.equal(page_bytes(dst.mamba, r), page_bytes(src.mamba, r))
