"""SGLang 0.5.23's real `HybridCacheController` over its real hybrid host pool
group, assembled outside a server the way SGLang's hybrid_pool_assembler
does it (for hicache_mp/bench/sglang/hybrid_rank.py).

What is SGLang's own: the host pools (hicache_mp/bench/sglang/real_hybrid.py: the
classes SGLang's `build_kv_host_pool` / `build_mamba_host_pool` /
`DSAIndexerHostPoolBuilder` build, on the "shm" allocator), every
`PoolEntry` (SGLang's `build_pool_entry`), the `HostPoolGroup`, and the
`HybridCacheController`, constructed with the arguments the assembler's
strategies pass (`build_hybrid_mamba_stack` for Qwen3-Next,
`build_hybrid_swa_stack` for gpt-oss, `_DsaStrategy.build` for
DeepSeek-V3.2; tp 1, cache host-memory mode). Its constructor builds the
backend through `StorageBackendFactory` from the dynamic config, registers
every pool (`register_mem_pool_host`, `register_mem_host_pool_v2` per
entry, `on_host_pools_registered`) and starts its storage threads
(prefetch, prefetch I/O, prefetch sync, backup) with their queues.

Stood in, device side only (no storage thread reads any of it):
- the token-to-KV allocator and the device KV pool the controller's
  constructor reads (`get_kvcache()`, `device`, `layer_num`,
  `register_layer_transfer_counter`): `sglang_real.DevicePool` for the MHA
  models; for DSA the `DSATokenToKVPool` subclass of
  `sglang_real_hybrid.dsa_device_pool` (its docstring says why), which keeps
  the controller's `isinstance(mem_pool_device, MLATokenToKVPool)` true, so
  the storage config says `is_mla_model` as a DeepSeek-V3.2 server's does.
- the `device_pool` of each `PoolEntry` (the same stand-ins) and no
  device alloc / evict callbacks: only the H2D / D2H load and write paths
  use them.
- no TP group (tp 1): the controller's all-reduces run over no groups.
The radix cache's part (which transfers a prefetch or a backup carries,
host staging at hit time) is the scheduler's, played by
hicache_mp/bench/sglang/hybrid_rank.py. Owns no engine logic.
"""
from __future__ import annotations

import os
import sys
import threading
from hicache_mp.bench.sglang import real as sglang_real


def layer_mappings(g: dict) -> tuple[dict, dict, int]:
    """(full-attention mapping, sidecar mapping, transfer_layer_id_max): model
    layer id -> pool layer, the full-attention layers spread evenly among the
    others as in Qwen3-Next (every 4th) and gpt-oss (every 2nd)."""
    full = g["layers"]
    other = g.get("mamba_layers") or g.get("swa_layers") or 0
    if not other:   # DSA: the indexer rides on every KV layer
        ident = {i: i for i in range(full)}
        return ident, dict(ident), full
    period = (full + other) // full
    full_ids = [i for i in range(full + other) if i % period == period - 1][:full]
    other_ids = [i for i in range(full + other) if i not in set(full_ids)]
    return ({gid: k for k, gid in enumerate(full_ids)},
            {gid: k for k, gid in enumerate(other_ids)}, full + other)


def build(pools, g: dict, *, backend: str, extra: dict, model: str, tp_rank: int = 0,
          tp_size: int = 1):
    """(HostPoolGroup, HybridCacheController) for `pools`
    (sglang_real_hybrid.hybrid_pools), the controller's threads running."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import \
        HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.pool_host import HostPoolGroup

    sglang_real.set_parallel(tp_rank, tp_size)
    full_map, side_map, top = layer_mappings(g)
    device_pool = pools.device or sglang_real.DevicePool(g["layers"], sglang_real.default_device())
    entries = [build_pool_entry(name=PoolName.KV, host_pool=pools.kv, device_pool=device_pool,
                                layer_mapping=full_map, transfer_layer_id_max=top,
                                is_anchor=True)]
    for name, pool in ((PoolName.MAMBA, pools.mamba), (PoolName.SWA, pools.swa),
                       (PoolName.INDEXER, pools.indexer)):
        if pool is not None:
            entries.append(build_pool_entry(name=name, host_pool=pool, device_pool=device_pool,
                                            layer_mapping=side_map, transfer_layer_id_max=top))
    group = HostPoolGroup(entries)
    ctl = HybridCacheController(
        device_pool, group, pools.kv.page_size, None, load_cache_event=threading.Event(),
        write_policy="write_through_selective", io_backend="direct", storage_backend=backend,
        prefetch_threshold=pools.kv.page_size, model_name=model,
        storage_backend_extra_config=dict(extra), transfer_layer_id_max=top,
        enable_storage_metrics=False, host_memory_mode="cache")
    return group, ctl
