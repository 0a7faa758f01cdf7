"""hicache_mp's linker behind SGLang 0.5.23's real `UnifiedRadixCache` and its
`UnifiedCacheLinkerWrapper` (decision 101), on CPU: dense (MHA), sliding
window (`SWAKVPool`) and Mamba (`HybridLinearKVPool` + `HybridReqToTokenPool`).

The scheduler's own calls drive it: an insert writes through (the tree's
`BackupKV` -> wrapper.offload_nodes -> our offload), `check_hicache_events`
acknowledges it, the device copy is evicted and its slots zeroed, then a
request with the same tokens is matched (wrapper.match -> our lookup),
loaded back (wrapper.load_back -> our load), started
(`ready_to_load_host_cache`), run through a forward stand-in that reads each
layer from the pools (so SGLang's own pools call `wait_until`), and finished
(`finish_external_linker_loads`). The request's device slots must then hold
the bytes that were computed, in the full pool and in the side pool.

Built as SGLang's own unified-radix-cache test kit builds its fixtures
(sglang/test/kits/unified_radix_cache), its ServerArgs published for the test
alone (`override_server_args`).

Reaches inside: `real._ensure_torchvision` (hicache_mp.bench.sglang.real), the
bench's placeholder for torchvision's import-time-only uses (SGLang's model
configs import it; CI has no CPU build).
"""
from array import array

import pytest
import torch

from hicache_mp.bench.sglang import real

real._ensure_torchvision()  # noqa: E402

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape  # noqa: E402
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, InitLoadBackParams,  # noqa: E402
                                                    InsertParams)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import match_kv_cache, release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.memory_pool import (HybridLinearKVPool, HybridReqToTokenPool,  # noqa: E402
                                              MHATokenToKVPool, ReqToTokenPool)
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import \
    create_unified_cache_linker  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402

L, H, D, PS, SIZE, DT, WINDOW = 4, 2, 8, 4, 128, torch.bfloat16, 8
FULL_LAYERS, SIDE_LAYERS = [3], [0, 1, 2]
TOKENS = list(range(100, 116))  # 4 pages


def req(rid, tokens):
    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=1))


def rows(pool, name, idx):
    """The bytes a pool holds at `idx`: every K/V layer's rows, or a Mamba slot's states."""
    if name == PoolName.MAMBA:
        c = pool.mamba_cache
        return [x[:, idx].clone() for x in (c.temporal, *c.conv)]
    return [b[idx].clone() for b in (*pool.k_buffer, *pool.v_buffer)]


def scribble(pool, name, idx, fill=None):
    tensors = ([pool.mamba_cache.temporal, *pool.mamba_cache.conv] if name == PoolName.MAMBA
               else [*pool.k_buffer, *pool.v_buffer])
    for t in tensors:
        view = t[:, idx] if name == PoolName.MAMBA else t[idx]
        new = torch.randn(view.shape).to(t.dtype) if fill is None else torch.zeros_like(view)
        if name == PoolName.MAMBA:
            t[:, idx] = new
        else:
            t[idx] = new


class Tree:
    """One rank's cache, built as SGLang's registry builds it with a linker."""

    def __init__(self, mode, store):
        self.mode = mode
        # ServerArgs published for this test only, and the previous context put
        # back at close(): published for good, they would clash with later tests'
        # parallel topologies. The chunk size is one a dummy model config cannot give.
        self.published = get_context().override_server_args(page_size=PS,
                                                             _mamba_cache_chunk_size=64)
        args = self.published.install()
        extra = {}
        if mode == "swa":
            self.r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu",
                                      enable_memory_saver=False)
            self.kv = SWAKVPool(size=SIZE, size_swa=SIZE, page_size=PS, dtype=DT, head_num=H,
                                head_dim=D, swa_attention_layer_ids=SIDE_LAYERS,
                                full_attention_layer_ids=FULL_LAYERS, device="cpu")
            self.alloc = SWATokenToKVPoolAllocator(size=SIZE, size_swa=SIZE, page_size=PS,
                                                   dtype=DT, device="cpu", kvcache=self.kv,
                                                   need_sort=False)
            extra = {"sliding_window_size": WINDOW}
            comps = (ComponentType.FULL, ComponentType.SWA)
        elif mode == "mamba":
            with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
                shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1,
                                                num_heads=2, head_dim=16, state_size=16,
                                                conv_kernel=4)
                cache_params = Mamba2CacheParams(shape=shape, layers=SIDE_LAYERS)
            self.r2t = HybridReqToTokenPool(
                size=4, mamba_size=20, mamba_spec_state_size=4, max_context_len=64,
                device="cpu", enable_memory_saver=False, cache_params=cache_params,
                mamba_layer_ids=SIDE_LAYERS, enable_mamba_extra_buffer=True,
                speculative_num_draft_tokens=3)
            self.kv = HybridLinearKVPool(size=SIZE, dtype=DT, page_size=PS, head_num=H,
                                         head_dim=D, full_attention_layer_ids=FULL_LAYERS,
                                         device="cpu", enable_memory_saver=False,
                                         mamba_pool=self.r2t.mamba_pool)
            self.alloc = PagedTokenToKVPoolAllocator(size=SIZE, page_size=PS, dtype=DT,
                                                     device="cpu", kvcache=self.kv,
                                                     need_sort=False)
            extra = {"enable_mamba_extra_buffer": True}
            comps = (ComponentType.FULL, ComponentType.MAMBA)
        else:
            self.r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu",
                                      enable_memory_saver=False)
            self.kv = MHATokenToKVPool(size=SIZE, page_size=PS, dtype=DT, head_num=H, head_dim=D,
                                       layer_num=L, device="cpu", enable_memory_saver=False)
            self.alloc = PagedTokenToKVPoolAllocator(size=SIZE, page_size=PS, dtype=DT,
                                                     device="cpu", kvcache=self.kv,
                                                     need_sort=False)
            comps = (ComponentType.FULL,)
        params = CacheInitParams(disable=False, req_to_token_pool=self.r2t,
                                 token_to_kv_pool_allocator=self.alloc, page_size=PS,
                                 tree_components=comps, **extra)
        self.cache = UnifiedRadixCache(params)
        cfg = {"linker": "HiCacheMPLinker",
               "linker_module_path": "hicache_mp.integrations.sglang.linker",
               "linker_extra_config": {"storage_dir": str(store), "num_workers": 1,
                                       "load_pages": 16, "layer_groups": 1}}
        self.linker = create_unified_cache_linker(args, params, backend="dynamic", config=cfg,
                                                  components=set(self.cache.components))
        # registry.default_radix_cache_factory's steps after the factory:
        self.cache.init_cache_linker(self.linker)
        self.kv.register_layer_transfer_counter(self.cache.linker.layer_done_counter)
        self.full = self.kv.full_kv_pool if hasattr(self.kv, "full_kv_pool") else self.kv
        self.side = {"swa": (PoolName.SWA, self.kv.swa_kv_pool) if mode == "swa" else None,
                     "mamba": (PoolName.MAMBA, self.r2t.mamba_pool) if mode == "mamba"
                     else None}.get(mode)

    def close(self):
        try:
            self.linker.close()
        finally:
            self.published.restore()

    def acknowledge_offloads(self):
        """The scheduler's check_hicache_events, each step, until the write-through lands."""
        import time
        deadline = time.monotonic() + 20
        while self.cache.linker.pending_offloads:
            assert time.monotonic() < deadline, "offload never acknowledged"
            self.cache.check_hicache_events()
            time.sleep(0.005)


def compute_and_insert(t: Tree):
    """A request's KV computed and inserted; (full slots, side slots, their bytes)."""
    n = len(TOKENS)
    if t.mode == "dense":  # the scheduler's release_kv_cache of a finished request
        r1 = req("r1", TOKENS)
        t.r2t.alloc([r1])
        full = t.alloc.alloc(n)
        scribble(t.full, PoolName.KV, full)
        t.r2t.write((r1.kv.req_pool_idx, slice(0, n)), full)
        r1.full_untruncated_fill_ids = array("q", TOKENS)
        r1.extend_end = n
        r1.kv.kv_committed_len = r1.kv.kv_allocated_len = n
        r1.kv.cache_protected_len = 0
        r1.last_node, r1.lock = t.cache.root_node_handle(), None
        r1.finished_reason = FINISH_LENGTH(length=0)
        snap = rows(t.full, PoolName.KV, full)
        release_kv_cache(r1, t.cache, checkpoint=True)
        return snap, None
    params = InsertParams(key=RadixKey(array("q", TOKENS)))
    if t.mode == "swa":  # the allocator's alloc wants page size 1: as SGLang's kit allocates
        full = t.alloc.full_attn_allocator.alloc(n)
        side = t.alloc.swa_attn_allocator.alloc(n)
        t.alloc.full_to_swa_index_mapping[full] = side
    else:
        full = t.alloc.alloc(n)
        r1 = req("r1", TOKENS)
        t.r2t.alloc([r1])
        side = r1.kv.mamba_pool_idx.unsqueeze(0)
        params.mamba_value = side
    params.value = full.clone()
    scribble(t.full, PoolName.KV, full)
    name, pool = t.side
    scribble(pool, name, side)
    snap_full, snap_side = rows(t.full, PoolName.KV, full), rows(pool, name, side)
    t.cache.insert(params)
    return snap_full, snap_side


@pytest.mark.parametrize("mode", ["dense", "swa", "mamba"])
def test_the_tree_stores_evicts_matches_and_loads_back_byte_for_byte(tmp_path, mode):
    t = Tree(mode, tmp_path)
    try:
        assert set(t.linker.pools) == {PoolName.KV} | ({t.side[0]} if t.side else set())
        snap_full, snap_side = compute_and_insert(t)
        t.acknowledge_offloads()
        n = len(TOKENS)
        t.cache.evict(EvictParams(num_tokens=n, swa_num_tokens=n if mode == "swa" else 0,
                                  mamba_num=1 if mode == "mamba" else 0))
        scribble(t.full, PoolName.KV, slice(None), fill=0)  # the freed slots forget the bytes
        if t.side:
            scribble(t.side[1], t.side[0], slice(None), fill=0)

        r2 = req("r2", TOKENS + [7, 8])
        if mode == "mamba":
            t.r2t.alloc([r2])
        m = match_kv_cache(r2, t.cache)
        assert m.device_prefix_len == 0 and m.host_hit_length == n
        loaded, r2.last_node = t.cache.init_load_back(InitLoadBackParams(
            best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=r2))
        assert loaded == n
        r2.prefix_len += loaded
        dev = t.cache.prefix_device_indices(r2)
        index = t.cache.ready_to_load_host_cache()
        assert index >= 0
        t.cache.linker.layer_done_counter.set_consumer(index)
        for layer_id in range(L):  # the forward: each layer's read waits in SGLang's pools
            if mode == "mamba" and layer_id in SIDE_LAYERS:
                t.r2t.mamba2_layer_cache(layer_id)
            else:
                t.kv.get_key_buffer(layer_id)
        assert t.cache.finish_external_linker_loads([r2]) == []
        got = rows(t.full, PoolName.KV, dev)
        assert all(torch.equal(a, b) for a, b in zip(got, snap_full))
        if mode == "swa":  # the window's tail: the pages SGLang restores
            side_dev = t.alloc.full_to_swa_index_mapping[dev[-WINDOW:]]
            got = rows(t.kv.swa_kv_pool, PoolName.SWA, side_dev)
            assert all(torch.equal(a, b[-WINDOW:]) for a, b in zip(got, snap_side))
        elif mode == "mamba":
            got = rows(t.r2t.mamba_pool, PoolName.MAMBA, r2.kv.mamba_pool_idx.unsqueeze(0))
            assert all(torch.equal(a, b) for a, b in zip(got, snap_side))
    finally:
        t.close()
