"""What SGLang's device pools look like to the direct linker (decision 101).

Owns reading an SGLang 0.5.23 cache's device pools into what the linker
moves: the full-attention KV planes (`k_buffer`/`v_buffer`, or MLA's
`kv_buffer`) and their page geometry; the counter's layer indices (what the
forward passes to `wait_until`: `layer_id - start_layer` of the pool that
waits) and which full-attention layer each is; and the side pools' row
planes, SWA's K/V rows per token and Mamba's state per slot. Plain dense and
SWA pools are read here because SGLang's own helper
(`resolve_hybrid_device_pool_group`) refuses them in 0.5.23.

Must not move bytes (`device.layered` does) or hold engines.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shm import PageGeometry

SUPPORTED = ("MHATokenToKVPool and MLATokenToKVPool (dense), SWAKVPool (sliding window), "
             "HybridLinearKVPool with a Mamba state pool")


@dataclass
class SidePool:
    """A side pool's bytes as row planes: page p of a transfer is, for each
    plane in order, `rows_per_page` rows at the transfer's device indices."""
    name: str
    planes: list                 # device tensors, each [rows, ...], contiguous
    rows_per_page: int
    pool: object                 # SGLang's pool object (the linker's `pools` entry)

    @property
    def row_bytes(self) -> list:
        return [t[0].numel() * t.element_size() for t in self.planes]

    @property
    def page_bytes(self) -> int:
        return self.rows_per_page * sum(self.row_bytes)

    def describe(self) -> str:
        """The byte layout, for the namespace: pages of another layout never match."""
        return f"rows={self.rows_per_page}x" + ",".join(
            f"{tuple(t.shape[1:])}:{str(t.dtype).removeprefix('torch.')}" for t in self.planes)

    def geometry(self) -> PageGeometry:
        """Opaque bytes to the engine: one page of `page_bytes` uint8."""
        return PageGeometry(num_layers=1, num_kv_heads=1, head_dim=self.page_bytes,
                            page_size=1, dtype="uint8")


@dataclass
class DevicePools:
    planes: list                 # full-attention KV planes [kv][full layer]
    geometry: PageGeometry       # of a full-attention KV page
    full_pool: object            # SGLang's full-attention pool (the `pools` KV entry)
    counter_layers: int          # indices the forward waits on
    full_layer: dict             # counter index -> full-attention layer, where it is one
    side: dict = field(default_factory=dict)   # "swa" / "mamba" -> SidePool


def read(params, page_size: int, components) -> DevicePools:
    """The pools of `params` (SGLang's CacheInitParams); ValueError naming what
    is served for anything else."""
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    full = getattr(kvcache, "full_kv_pool", kvcache)
    if hasattr(full, "k_buffer") and hasattr(full, "v_buffer"):
        planes, mla = [list(full.k_buffer), list(full.v_buffer)], False
    elif hasattr(full, "kv_buffer"):
        planes, mla = [list(full.kv_buffer)], True
    else:
        raise ValueError(f"hicache_mp's linker serves {SUPPORTED}; {type(kvcache).__name__} "
                         "is not one of them. Use --enable-hierarchical-cache with hicache_mp's "
                         "HiCache backend for other pools")
    first = planes[0][0]
    heads, dim = (1, first[0].numel()) if mla else (first.shape[1], first[0][0].numel())
    geometry = PageGeometry(num_layers=len(planes[0]), num_kv_heads=int(heads), head_dim=int(dim),
                            page_size=page_size, dtype=str(first.dtype).removeprefix("torch."),
                            mla=mla)
    start = int(getattr(kvcache, "start_layer", 0) or 0)
    side = {}
    names = {getattr(c, "name", str(c)).upper() for c in components}
    if hasattr(kvcache, "layers_mapping"):  # SWAKVPool: global layer -> (local, is_swa)
        full_layer = {gid - start: local for gid, (local, swa) in kvcache.layers_mapping.items()
                      if not swa}
        counter_layers = max(kvcache.layers_mapping) + 1 - start
        swa = kvcache.swa_kv_pool
        if "SWA" in names:
            side["swa"] = SidePool("swa", list(swa.k_buffer) + list(swa.v_buffer), page_size, swa)
    elif hasattr(kvcache, "full_attention_layer_id_mapping"):  # HybridLinearKVPool (Mamba)
        full_layer = {gid - start: local
                      for gid, local in kvcache.full_attention_layer_id_mapping.items()}
        r2t = params.req_to_token_pool
        mamba_ids = list(getattr(r2t, "mamba_map", {}) or {})
        counter_layers = max(list(kvcache.full_attention_layer_id_mapping) + mamba_ids) + 1 - start
        if "MAMBA" in names:
            cache = kvcache.mamba_pool.mamba_cache
            tensors = [cache.temporal, *cache.conv]
            side["mamba"] = SidePool("mamba", [t[j] for t in tensors for j in range(t.shape[0])],
                                     1, kvcache.mamba_pool)
    else:
        full_layer = {i: i for i in range(geometry.num_layers)}
        counter_layers = geometry.num_layers
    for name in names - {"FULL", "SWA", "MAMBA"}:
        raise ValueError(f"hicache_mp's linker serves FULL, SWA and MAMBA components, not {name}")
    return DevicePools(planes, geometry, full, counter_layers, full_layer, side)
