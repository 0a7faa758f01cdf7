"""hicache_mp behind SGLang's HiCache L3 storage interface (SGLang's `dynamic` backend).

    --enable-hierarchical-cache --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name":"hicache_mp",
        "module_path":"hicache_mp.integrations.sglang","class_name":"HiCacheMP",
        "interface_v1":1,"allocator":"shm","num_workers":8}'

    backend          HiCacheMP: SGLang's calls -> the engine's (imports SGLang)
    pools            the KV host pool's geometry and zero-copy plan
    staging          the KV staging path (no memfd, token-major layouts, legacy calls)
    indices          host indices -> page numbers (GIL kept)
    hybrid           v2: a hybrid model's sidecar pools, batch get/set
    hits             v2: batch_exists_v2's hit policies
    sidecar          v2: one sidecar pool's engine and page moves
    sidecar_layouts  v2: where a sidecar page's bytes lie in SGLang's pool
    settings         AdapterConfig and the keys SGLang reads
    names            SGLang's shard naming as engine namespaces
    layouts          SGLang's KV page layouts as views
    store_import     `hicache-mp import-sglang`: an SGLang `file` store converted
    fastpath         install() of SGLang's storage fast path (0.5.23 only), directly or
                     through SGLang's HookRegistry (the top-level hicache_mp_sglang_plugin
                     module, SGLang's plugin entry point, calls it); the patch text
    fastpath_methods the fast path's methods, as SGLang's source (no hicache_mp in them)
    serve            `hicache-mp sglang-serve`: HICACHE_MP_FASTPATH=1 and SGLang's own launcher
    upstream/        the fast path as a patch against SGLang 0.5.23, and its README

Only `backend` imports SGLang, and this package loads it when `HiCacheMP` is
first asked for: `settings`, `names`, `layouts` and `store_import` (the CLI,
the flags reference) work without SGLang; `fastpath` and `serve` import it
only when called. Must not import SGLang itself.
"""
from .settings import AdapterConfig

__all__ = ["HiCacheMP", "AdapterConfig"]


def __getattr__(name: str):
    if name == "HiCacheMP":
        # The backend imports SGLang (an ImportError saying so where it is
        # missing); this package's SGLang-free modules must load without it.
        from .backend import HiCacheMP
        globals()["HiCacheMP"] = HiCacheMP
        return HiCacheMP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
