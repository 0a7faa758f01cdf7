"""SGLang 0.5.23's real host pools and HiCacheController, importable and built
outside a server (for the stack harnesses beside this module and tests/integrations/).

Owns two things: (1) making SGLang's host-pool/controller import chain load
where torchvision is missing or does not match torch, and (2) building a real
`MHATokenToKVPoolHost` / `MLATokenToKVPoolHost` and a real `HiCacheController`
around them with SGLang's own storage threads and `StorageBackendFactory`.
Must not stand in for anything on the storage path: the host pool, the
controller's prefetch/backup threads, the factory (with its failure-injector
wrap) and the backends are SGLang's. Only the *device* side, which the storage
threads never touch, is a small object carrying the device pool's geometry.

Why the torchvision placeholder: `pool_host/__init__` -> `memory_pool` ->
`sglang.srt.configs` imports every model config, and a few of them
(InternVL, DeepSeek-OCR image processors) import torchvision at module level.
The only torchvision wheels for torch 2.13 on PyPI are CUDA builds that fail
against a CPU torch ("operator torchvision::nms does not exist"). Image
transforms are never called on the KV path, so when `import torchvision`
fails, a placeholder package answers those imports.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import importlib.machinery
import os
import sys
import types


# --- import chain ---------------------------------------------------------------
class _PlaceholderType(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _Placeholder(metaclass=_PlaceholderType):
    """Stands for any torchvision object; only ever referenced at import time."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Placeholder()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names=("torchvision",)):
        self.names = frozenset(names)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _PlaceholderModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0"  # transformers parses it; 0.0.0 turns its torchvision paths off
        return m

    def exec_module(self, module):
        pass


TORCHVISION_PLACEHOLDER = False


def _ensure_torchvision() -> None:
    global TORCHVISION_PLACEHOLDER
    if TORCHVISION_PLACEHOLDER:
        return
    try:
        import torchvision  # noqa: F401
        return
    except Exception:
        for k in [k for k in sys.modules if k.split(".")[0] == "torchvision"]:
            del sys.modules[k]
    sys.meta_path.insert(0, _TorchvisionPlaceholder())
    TORCHVISION_PLACEHOLDER = True


# GPU kernel packages that SGLang's quantization modules import at module level
# when CUDA is present (memory_pool -> layers.quantization -> ... -> sgl_kernel).
# The storage path never calls them; their wheels are CUDA builds far larger
# than a device call carries, so where one is missing a placeholder answers the
# import (said on stderr). Every byte the harness moves is still checked.
KERNEL_PACKAGES = ("sgl_kernel", "flashinfer", "deep_gemm")
KERNEL_PLACEHOLDERS: list = []


def _ensure_kernel_packages() -> None:
    import torch
    if not torch.cuda.is_available():
        return   # without CUDA SGLang does not import them (and may fall back on ImportError)
    missing = []
    for name in KERNEL_PACKAGES:
        if name in KERNEL_PLACEHOLDERS or importlib.util.find_spec(name) is not None:
            continue
        missing.append(name)
    if missing:
        sys.meta_path.insert(0, _TorchvisionPlaceholder(missing))
        KERNEL_PLACEHOLDERS.extend(missing)
        print(f"sglang_real: placeholders for missing kernel packages {missing} "
              f"(never called on the storage path)", file=sys.stderr)


def import_stack():
    """SGLang's modules for the storage stack, or ImportError saying what is missing."""
    _ensure_torchvision()
    _ensure_kernel_packages()
    from sglang.srt.managers import cache_controller
    from sglang.srt.mem_cache import device_pool_info, hicache_storage
    from sglang.srt.mem_cache.pool_host import mha, mla
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    return types.SimpleNamespace(
        cache_controller=cache_controller, HiCacheController=cache_controller.HiCacheController,
        hicache_storage=hicache_storage, HiCacheStorage=hicache_storage.HiCacheStorage,
        MHATokenToKVPoolHost=mha.MHATokenToKVPoolHost, MLATokenToKVPoolHost=mla.MLATokenToKVPoolHost,
        dpi=device_pool_info, StorageBackendFactory=StorageBackendFactory,
        get_storage_hash_str=get_storage_hash_str)


# --- the device side (never touched by the storage threads) --------------------
class DevicePool:
    """What HiCacheController.__init__ reads from the device KV pool and its
    allocator: `get_kvcache()`, `device`, `layer_num`,
    `register_layer_transfer_counter`. The storage threads use none of it."""

    def __init__(self, layer_num: int, device: str):
        self.layer_num, self.device = layer_num, device
        self.layer_transfer_counter = None

    def get_kvcache(self):
        return self

    def register_layer_transfer_counter(self, counter):
        self.layer_transfer_counter = counter


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def mha_host_pool(sgl, *, layers, heads, head_dim, page_size, pages, layout="layer_first",
                  allocator="shm", dtype=None, device=None):
    """A real MHATokenToKVPoolHost of `pages` pages (plus SGLang's padding page),
    built from a one-page device buffer description (SGLang 0.5.23 signature)."""
    import torch
    dtype = dtype or torch.bfloat16
    device = device or default_device()
    dev_tokens = page_size
    k = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype, device=device)
              for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype, device=device)
              for _ in range(layers))
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64, device=device)  # noqa: E731
    info = sgl.dpi.MHABufferInfo(
        buffers=sgl.dpi.KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                  layout=sgl.dpi.KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=dtype, device=k[0].device)  # cuda:0, as SGLang validates it
    return sgl.MHATokenToKVPoolHost(
        info, 1.0, 0, page_size, layout, pin_memory=(device == "cuda"), device="cpu",
        allocator_type=allocator, device_capacity_tokens=dev_tokens, start_layer=0,
        end_layer=layers, host_token_capacity=pages * page_size)


def set_parallel(tp_rank: int = 0, tp_size: int = 1) -> None:
    """The process's parallel layout, as SGLang's launcher would publish it."""
    from sglang.srt.runtime_context import get_parallel
    get_parallel().override_permanently(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)


def controller(sgl, host_pool, *, backend: str, extra: dict | None, model="hicache-mp/stack",
               enable_storage_metrics=False, tp_rank=0, tp_size=1, tp_group=None):
    """A real HiCacheController with its storage threads running on `backend`;
    with `tp_group` (a torch.distributed group of the ranks), its hit counts
    and acks are agreed across them as SGLang's TP ranks do."""
    import threading
    set_parallel(tp_rank, tp_size)
    dev = DevicePool(host_pool.layer_num, default_device())
    return sgl.HiCacheController(
        dev, host_pool, host_pool.page_size, tp_group=tp_group,
        load_cache_event=threading.Event(),
        io_backend="direct", storage_backend=backend, prefetch_threshold=host_pool.page_size,
        model_name=model, storage_backend_extra_config=dict(extra or {}),
        enable_storage_metrics=enable_storage_metrics)


def mp_extra(storage_dir: str, **keys) -> dict:
    """The extra-config for hicache_mp behind SGLang's dynamic backend."""
    return {"backend_name": "hicache_mp", "module_path": "hicache_mp.integrations.sglang",
            "class_name": "HiCacheMP", "interface_v1": 1, "allocator": "shm",
            "storage_dir": storage_dir, **keys}


def nobytes_extra(class_name: str = "NoBytes", name: str = "nobytes") -> dict:
    """nobytes's NoBytes (or Sleeping, as `name` "sleeping")."""
    return {"backend_name": name, "module_path": "hicache_mp.bench.sglang.nobytes", "class_name": class_name,
            "interface_v1": 1}

