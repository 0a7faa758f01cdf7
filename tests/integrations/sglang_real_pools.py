"""SGLang 0.5.23's REAL hybrid host pools, built on a CPU machine where possible.

`sglang.srt.mem_cache.pool_host` imports `sglang.srt.configs` -> transformers,
and `sglang/srt/multimodal/internvl_utils.py` then does `import
torchvision.transforms`. On torch 2.13.0+cpu no torchvision from PyPI loads
(the 0.28.0 wheel is the CUDA build: "operator torchvision::nms does not
exist"). Nothing on the host-pool path uses torchvision, so when it cannot be
imported, `load()` puts an empty stand-in for the `torchvision` package on the
import path (with a distribution record so transformers' version check
passes); nothing of torchvision is ever called. With transformers and the
few other modules of that import chain present, the pool classes then import
and build for real on CPU, with SGLang's own shm allocator (memfds):

    pip install --target DIR --no-deps transformers==5.19.0 huggingface-hub \
        tokenizers safetensors regex pyyaml filelock fsspec hf-xet dill \
        apache-tvm-ffi sentencepiece compressed-tensors loguru
    PYTHONPATH=DIR python3 -m pytest tests/integrations/test_sglang_v2_real_pools.py

(checked with transformers 5.24.0 and huggingface-hub 2.4.0 from a plain
`pip install --target DIR transformers`). Where these are missing, `load()`
raises ImportError naming the first missing module; the tests skip with it.

The DSA indexer host pool reads only attributes of its device pool
(`DSATokenToKVPool`, a CUDA pool); `dsa_device_pool()` gives it those
attributes on CPU tensors. Every other object here is SGLang's own class.
"""
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types
from types import SimpleNamespace

import torch


class _EmptyModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _EmptyModule(f"{self.__name__}.{name}")
        sys.modules[sub.__name__] = sub
        return sub

    def __call__(self, *args, **kwargs):
        return self


class _TorchvisionDist(importlib.metadata.Distribution):
    def read_text(self, filename):
        if filename == "METADATA":
            return "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.0.0\n"
        return None

    def locate_file(self, path):
        return path


class _EmptyTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _EmptyModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name in (None, "torchvision"):
            return iter([_TorchvisionDist()])
        return iter([])


def _torchvision_loads() -> bool:
    try:
        import torchvision  # noqa: F401
        return True
    except Exception:
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False


def load() -> SimpleNamespace:
    """SGLang's real host-pool classes (ImportError if they cannot be imported here)."""
    if not _torchvision_loads() and not any(isinstance(f, _EmptyTorchvision)
                                            for f in sys.meta_path):
        sys.meta_path.insert(0, _EmptyTorchvision())
    from sglang.srt.mem_cache.device_pool_info import (KVBufferLayout, KVBuffers,
                                                       MambaStateBufferInfo, MHABufferInfo,
                                                       MLABufferInfo)
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
    from sglang.srt.mem_cache.pool_host.host_pool_decl import HostPoolDecl, HostPoolStorageInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    return SimpleNamespace(**{k: v for k, v in locals().items()})


def _ptrs(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(S, *, layout, layers=2, heads=2, head_dim=16, page_size=4, tokens=32,
             dtype=torch.bfloat16):
    """MHATokenToKVPoolHost over CPU device buffers, "allocator": "shm"."""
    k = tuple(torch.zeros(tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(tokens + page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = S.MHABufferInfo(
        buffers=S.KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                            layout=S.KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=torch.device("cpu"))
    return S.MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False,
                                  device="cpu", allocator_type="shm",
                                  device_capacity_tokens=tokens, start_layer=0, end_layer=layers)


def mla_pool(S, *, layout, layers=2, page_size=4, tokens=32, rank=16, rope=4,
             dtype=torch.bfloat16):
    dim = rank + rope
    bufs = tuple(torch.zeros(tokens + page_size, 1, dim, dtype=dtype) for _ in range(layers))
    info = S.MLABufferInfo(buffers=bufs, data_ptrs=_ptrs(bufs), layer_indices=tuple(range(layers)),
                           device_layer_num=layers, page_size=page_size, kv_lora_rank=rank,
                           qk_rope_head_dim=rope, kv_cache_dim=dim, dtype=dtype,
                           device=torch.device("cpu"))
    return S.MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False,
                                  device="cpu", allocator_type="shm",
                                  device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
                                  target_layer_num=layers)


def mamba_pool(S, *, layers=2, slots=6, temporal=(2, 4, 4), conv=((3, 8),),
               layout="page_first"):
    """MambaPoolHost: fp32 temporal + bf16 conv state, each its own memfd."""
    info = S.MambaStateBufferInfo(
        temporal=torch.zeros((layers, slots) + tuple(temporal)),
        conv=tuple(torch.zeros((layers, slots) + tuple(c), dtype=torch.bfloat16) for c in conv))
    return S.MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                           allocator_type="shm", layout=layout)


def dsa_device_pool(*, layers=2, page_size=4, tokens=32, bytes_per_token=6):
    """The attributes DSAIndexerPoolHost reads from its DSATokenToKVPool."""
    return SimpleNamespace(
        layer_shard_enabled=False, skip_topk_layers=[False] * layers, store_dtype=torch.uint8,
        start_layer=0, end_layer=layers, layer_num=layers, device="cpu", page_size=page_size,
        index_k_with_scale_buffer=[torch.zeros(tokens // page_size + 1,
                                               page_size * bytes_per_token, dtype=torch.uint8)
                                   for _ in range(layers)])


def dsa_indexer_pool(S, anchor, *, bytes_per_token=6):
    from sglang.srt.mem_cache.hicache_storage import PoolName
    dev = dsa_device_pool(layers=anchor.layer_num, page_size=anchor.page_size,
                          bytes_per_token=bytes_per_token)
    decl = S.HostPoolDecl(pool_name=PoolName.INDEXER, device_pool=dev,
                          indices_from_pool=PoolName.KV, layout_source=PoolName.KV,
                          storage_info=S.HostPoolStorageInfo(
                              bytes_per_token_per_layer=bytes_per_token, dtype=torch.uint8),
                          host_pool_builder=None)
    return S.DSAIndexerPoolHost(decl, anchor, pin_memory=False, device="cpu",
                                allocator_type="shm")


def fill_random(pool, gen) -> None:
    """Random bytes in every host tensor of an SGLang host pool."""
    tensors = []
    for name in ("kv_buffer", "temporal_buffer", "index_k_with_scale_buffer"):
        t = getattr(pool, name, None)
        if isinstance(t, torch.Tensor):
            tensors.append(t)
    tensors += list(getattr(pool, "conv_buffer", None) or [])
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
        if t.is_floating_point():   # no NaN payloads: bytes compare either way, values stay sane
            t.copy_(torch.nan_to_num(t, nan=0.0, posinf=1.0, neginf=-1.0))
