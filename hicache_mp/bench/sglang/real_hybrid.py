"""SGLang 0.5.23's REAL hybrid host pools, built outside a server (on CPU too),
for scripts/sglang_hybrid_check.py and tests/integrations/test_sglang_v2_real_pools.py.

The import chain is hicache_mp/bench/sglang/real.py's (`import_stack()`: transformers
and the modules of .ci/sglang-stack-requirements.txt, and a placeholder for
torchvision's import-time-only uses where no torchvision loads). On top of
it this module imports and builds the sidecar pools: `MambaPoolHost`,
`DSAIndexerPoolHost`, and MHA/MLA host pools in every layout, each with
SGLang's own shm allocator (memfds). Where the chain cannot be imported,
`load()` raises the ImportError naming the first missing module.

The DSA indexer host pool reads only attributes of its device pool
(`DSATokenToKVPool`, a CUDA pool); `dsa_device_pool()` gives it those
attributes on CPU tensors, as an instance of a `DSATokenToKVPool` subclass
whose `__init__` allocates nothing (a real one wants 64-token pages, a
128-dim indexer and CUDA kernels), so that it also stands for the device KV
pool of hicache_mp/bench/sglang/hybrid_controller.py's controller. Every other object
here is SGLang's own class.
"""
import os
import sys
from types import SimpleNamespace

import torch

from hicache_mp.bench.sglang import real as sglang_real


def load() -> SimpleNamespace:
    """SGLang's real host-pool classes (ImportError if they cannot be imported here)."""
    sglang_real.import_stack()
    from sglang.srt.mem_cache.device_pool_info import (KVBufferLayout, KVBuffers,
                                                       MambaStateBufferInfo, MHABufferInfo,
                                                       MLABufferInfo)
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
    from sglang.srt.mem_cache.pool_host.host_pool_decl import HostPoolDecl, HostPoolStorageInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    return SimpleNamespace(**{k: v for k, v in locals().items()})


def _ptrs(tensors, device="cpu"):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


def _dev(device):
    return device or sglang_real.default_device()


def mha_pool(S, *, layout, layers=2, heads=2, head_dim=16, page_size=4, tokens=32,
             dtype=torch.bfloat16, device=None, allocator="shm"):
    """MHATokenToKVPoolHost of 2 * `tokens` host tokens (plus SGLang's padding
    page) over a one-page device buffer (on the GPU where there is one),
    "allocator": "shm"."""
    device = _dev(device)
    k = tuple(torch.zeros(page_size, heads, head_dim, dtype=dtype, device=device)
              for _ in range(layers))
    v = tuple(torch.zeros(page_size, heads, head_dim, dtype=dtype, device=device)
              for _ in range(layers))
    info = S.MHABufferInfo(
        buffers=S.KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k, device), v_data_ptrs=_ptrs(v, device),
                            layout=S.KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=k[0].device)
    return S.MHATokenToKVPoolHost(info, 1.0, 0, page_size, layout,
                                  pin_memory=device == "cuda", device="cpu",
                                  allocator_type=allocator, device_capacity_tokens=page_size,
                                  start_layer=0, end_layer=layers,
                                  host_token_capacity=2 * tokens)


def mla_pool(S, *, layout, layers=2, page_size=4, tokens=32, rank=16, rope=4,
             dtype=torch.bfloat16, device=None, allocator="shm"):
    device = _dev(device)
    dim = rank + rope
    bufs = tuple(torch.zeros(page_size, 1, dim, dtype=dtype, device=device)
                 for _ in range(layers))
    info = S.MLABufferInfo(buffers=bufs, data_ptrs=_ptrs(bufs, device),
                           layer_indices=tuple(range(layers)), device_layer_num=layers,
                           page_size=page_size, kv_lora_rank=rank, qk_rope_head_dim=rope,
                           kv_cache_dim=dim, dtype=dtype, device=bufs[0].device)
    return S.MLATokenToKVPoolHost(info, 1.0, 0, page_size, layout,
                                  pin_memory=device == "cuda", device="cpu",
                                  allocator_type=allocator, device_capacity_tokens=page_size,
                                  start_layer=0, end_layer=layers, target_layer_num=layers,
                                  host_token_capacity=2 * tokens)


def mamba_pool(S, *, layers=2, slots=6, temporal=(2, 4, 4), conv=((3, 8),),
               layout="page_first", extra=(), device=None, allocator="shm"):
    """MambaPoolHost: fp32 temporal + bf16 conv state(s), each its own memfd.
    `extra`: (shape, dtype) of extra checkpoint buffers (the pool's
    slot_state_buffers: one row per slot, no layer axis), also one memfd each."""
    device = _dev(device)
    info = S.MambaStateBufferInfo(
        temporal=torch.zeros((layers, slots) + tuple(temporal), device=device),
        conv=tuple(torch.zeros((layers, slots) + tuple(c), dtype=torch.bfloat16, device=device)
                   for c in conv),
        extra_checkpoint_buffers=tuple(torch.zeros((slots,) + tuple(shape), dtype=dtype,
                                                   device=device) for shape, dtype in extra))
    return S.MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=device == "cuda",
                           device="cpu", allocator_type=allocator, layout=layout)


_DSA_DEVICE_CLS = []


def _dsa_device_cls():
    """The DSATokenToKVPool subclass (the module docstring says why), made once."""
    if not _DSA_DEVICE_CLS:
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        class DsaDevicePool(DSATokenToKVPool):
            def __init__(self, **attrs):   # no super().__init__: it allocates device buffers
                self.__dict__.update(attrs)
                self.layer_transfer_counter = None

            def get_kvcache(self):   # the controller's allocator stand-in, too
                return self

            def register_layer_transfer_counter(self, counter):
                self.layer_transfer_counter = counter

        _DSA_DEVICE_CLS.append(DsaDevicePool)
    return _DSA_DEVICE_CLS[0]


def dsa_device_pool(*, layers=2, page_size=4, tokens=32, bytes_per_token=6, device="cpu"):
    """The attributes DSAIndexerPoolHost (and the controller) read from its DSATokenToKVPool."""
    bufs = [torch.zeros(tokens // page_size + 1, page_size * bytes_per_token, dtype=torch.uint8,
                        device=device) for _ in range(layers)]
    return _dsa_device_cls()(
        layer_shard_enabled=False, skip_topk_layers=[False] * layers, store_dtype=torch.uint8,
        dtype=torch.uint8, start_layer=0, end_layer=layers, layer_num=layers, device=device,
        page_size=page_size, index_key_cache=SimpleNamespace(buffer=bufs))


def dsa_indexer_pool(S, anchor, *, bytes_per_token=6, allocator="shm", device_pool=None):
    from sglang.srt.mem_cache.hicache_storage import PoolName
    dev = device_pool or dsa_device_pool(layers=anchor.layer_num, page_size=anchor.page_size,
                                         bytes_per_token=bytes_per_token)
    decl = S.HostPoolDecl(pool_name=PoolName.INDEXER, device_pool=dev,
                          indices_from_pool=PoolName.KV, layout_source=PoolName.KV,
                          storage_info=S.HostPoolStorageInfo(
                              bytes_per_token_per_layer=bytes_per_token, dtype=torch.uint8),
                          host_pool_builder=None)
    # pinned where a server pins it (its builder's default), on a GPU box
    return S.DSAIndexerPoolHost(decl, anchor, pin_memory=dev.device == "cuda", device="cpu",
                                allocator_type=allocator)


def fill_random(pool, gen) -> None:
    """Random bytes in every host tensor of an SGLang host pool."""
    tensors = []
    for name in ("kv_buffer", "temporal_buffer", "index_k_with_scale_buffer"):
        t = getattr(pool, name, None)
        if isinstance(t, torch.Tensor):
            tensors.append(t)
    tensors += list(getattr(pool, "conv_buffer", None) or [])
    tensors += list(getattr(pool, "slot_state_buffers", None) or [])
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
        if t.is_floating_point():   # no NaN payloads: bytes compare either way, values stay sane
            t.copy_(torch.nan_to_num(t, nan=0.0, posinf=1.0, neginf=-1.0))


# --- the hybrid geometries of scripts/sglang_hybrid_check.py ---------------------
# Per model, tp 1, bf16 KV, SGLang's page of 64 tokens. `tiny`: the same pool
# kinds at a few KiB a page (CPU tests and smoke runs).
GEOMETRIES = {
    # Qwen3-Next-80B-A3B: 12 full-attention layers (2 KV heads of 256) and 36
    # linear-attention layers, one Mamba state (fp32 temporal 32x128x128, bf16
    # conv 8192x3 per layer) per prefix, read for its last page.
    "mamba": dict(model="Qwen3-Next-80B-A3B", kv="mha", layers=12, heads=2, head_dim=256,
                  page_size=64, mamba_layers=36, temporal=(32, 128, 128), conv=((8192, 3),)),
    # gpt-oss-120b: 18 full and 18 sliding-window layers (8 KV heads of 64), a
    # 128-token window: the SWA pool holds a prefix's last 2 pages.
    "swa": dict(model="gpt-oss-120b", kv="mha", layers=18, heads=8, head_dim=64, page_size=64,
                swa_layers=18, window_pages=2),
    # DeepSeek-V3.2: MLA (512 + 64 rope) over 61 layers and the DSA indexer's
    # 128 fp8 dims + fp32 scale per token per layer, read with every KV page.
    "dsa": dict(model="DeepSeek-V3.2", kv="mla", layers=61, rank=512, rope=64, page_size=64,
                indexer_bytes=132),
}
TINY = {
    "mamba": dict(layers=2, heads=2, head_dim=32, page_size=8, mamba_layers=2,
                  temporal=(2, 8, 8), conv=((32, 3),)),
    "swa": dict(layers=2, heads=2, head_dim=32, page_size=8, swa_layers=2),
    "dsa": dict(layers=2, rank=32, rope=8, page_size=8, indexer_bytes=12),
}


def geometry(name: str, tiny: bool = False) -> dict:
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r} (one of {', '.join(GEOMETRIES)})")
    g = dict(GEOMETRIES[name], name=name)
    if tiny:
        g.update(TINY[name])
    return g


def hybrid_pools(S, g: dict, *, kv_pages: int, prefixes: int) -> SimpleNamespace:
    """SGLang's real host pools of geometry `g`: `kv_pages` KV pages (plus
    SGLang's padding), and the sidecar pool: one Mamba slot or one SWA
    window per prefix, or the DSA indexer over the KV pool. All on the shm
    allocator, in the page_first_direct layout (the Mamba pool takes the KV
    pool's, as SGLang's build_hybrid_mamba_stack does). `device`: the DSA
    device pool stand-in (None for the MHA models)."""
    P, tokens = g["page_size"], kv_pages * g["page_size"] // 2   # the builders double it
    out = SimpleNamespace(kv=None, mamba=None, swa=None, indexer=None, device=None)
    if g["kv"] == "mla":
        out.kv = mla_pool(S, layout="page_first_direct", layers=g["layers"], page_size=P,
                          tokens=tokens, rank=g["rank"], rope=g["rope"])
        out.device = dsa_device_pool(layers=g["layers"], page_size=P,
                                     bytes_per_token=g["indexer_bytes"],
                                     device=sglang_real.default_device())
        out.indexer = dsa_indexer_pool(S, out.kv, bytes_per_token=g["indexer_bytes"],
                                       device_pool=out.device)
    else:
        out.kv = mha_pool(S, layout="page_first_direct", layers=g["layers"], heads=g["heads"],
                          head_dim=g["head_dim"], page_size=P, tokens=tokens)
    if "mamba_layers" in g:
        out.mamba = mamba_pool(S, layers=g["mamba_layers"], slots=prefixes,
                               temporal=g["temporal"], conv=g["conv"], layout="page_first_direct")
    if "swa_layers" in g:
        out.swa = mha_pool(S, layout="page_first_direct", layers=g["swa_layers"],
                           heads=g["heads"], head_dim=g["head_dim"], page_size=P,
                           tokens=prefixes * g.get("window_pages", 2) * P // 2)
    return out


def fill_words(pool, gen) -> None:
    """Random bytes in every host tensor of `pool`, 8 at a time (a GiB in a
    second or two; `fill_random`'s bytewise randint is several times slower).
    Float payloads may hold NaNs: compare pages as bytes."""
    for name in ("kv_buffer", "temporal_buffer", "index_k_with_scale_buffer"):
        t = getattr(pool, name, None)
        if isinstance(t, torch.Tensor):
            _fill(t, gen)
    for t in list(getattr(pool, "conv_buffer", None) or []):
        _fill(t, gen)


def _fill(t, gen) -> None:
    raw = t.view(torch.uint8).view(-1)
    for a in range(0, raw.numel(), 1 << 28):
        chunk = raw[a:a + (1 << 28)]
        n = chunk.numel() - chunk.numel() % 8
        if n:
            chunk[:n].view(torch.int64).random_(generator=gen)
        if n < chunk.numel():
            chunk[n:].copy_(torch.randint(0, 256, (chunk.numel() - n,), generator=gen,
                                          dtype=torch.uint8))
