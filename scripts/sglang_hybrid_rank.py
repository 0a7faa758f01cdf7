"""One rank of scripts/sglang_hybrid_check.py: SGLang's real hybrid host pools,
one backend built by SGLang's StorageBackendFactory, and the storage calls
SGLang's HybridCacheController makes (0.5.23) for a backup and a prefetch.

The pools hold two regions: `src` (random bytes, backed up) and `dst` (read
into, zeroed before each run and compared with `src` after it, KV and
sidecar pages alike). Owns no engine logic; the backend is imported only
through SGLang's factory (the dynamic config names
`hicache_mp.integrations.sglang`.HiCacheMP or scripts/sglang_nobytes.py).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_real  # noqa: E402
import sglang_real_hybrid as RH  # noqa: E402

BATCH = 128   # SGLang's STORAGE_BATCH_SIZE
SRC, DST = 0, 1
# On CUDA every host pool is cudaHostRegister'ed and nothing unregisters it:
# freeing one lets the next pools be mapped at the same address, and
# registering that range again fails (cudaError 712). They live until exit.
_KEEP_POOLS: list = []
_fresh = itertools.count()


class Rank:
    def __init__(self, S, hs, g: dict, kind: str, store: str, *, requests: int, max_pages: int,
                 workers: int):
        from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageExtraInfo, PoolHitPolicy,
                                                          PoolName, PoolTransfer)
        self.T, self.N, self.H = PoolTransfer, PoolName, PoolHitPolicy
        self.X = HiCacheStorageExtraInfo
        self.kind, self.g, self.requests, self.top = kind, g, requests, max_pages
        self.P, self.W = g["page_size"], g.get("window_pages", 2)
        # the no-bytes backend never touches a pool: small ones (on CUDA each pool
        # is pinned; the indices of a round are the same either way). SGLang's MLA
        # page_first_direct pool wants at least a page per layer.
        pages, prefixes = ((2 * requests * max_pages, 2 * requests) if kind == "mp"
                           else (max(2, g["layers"]), 2))
        self.pools = RH.hybrid_pools(S, g, kv_pages=pages, prefixes=prefixes)
        _KEEP_POOLS.append(self.pools)
        if kind == "mp":
            gen = torch.Generator().manual_seed(11)
            for pool in self.side_pools() + [self.pools.kv]:
                RH.fill_words(pool, gen)
            extra = sglang_real.mp_extra(store, num_workers=workers)
        elif kind == "nobytes":
            extra = sglang_real.nobytes_extra()
        else:
            raise ValueError(f"unknown backend {kind!r} (mp, nobytes)")
        cfg = hs.HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=g["kv"] == "mla", enable_storage_metrics=False,
            is_page_first_layout=False, model_name=f"hicache-mp/{g['name']}", extra_config=extra)
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        self.backend = StorageBackendFactory.create_backend("dynamic", cfg, self.pools.kv)
        self.backend.register_mem_pool_host(self.pools.kv)
        self.backend.register_mem_host_pool_v2(self.pools.kv, PoolName.KV)
        for name, pool in self.named_sidecars():
            self.backend.register_mem_host_pool_v2(pool, name)
        self.backend.on_host_pools_registered()
        self.calls = collections.Counter()   # backend calls made, by name
        self.wrong = self.checked = 0
        self._keys, self._idx = {}, {}

    def named_sidecars(self):
        p, N = self.pools, self.N
        return [(n, x) for n, x in ((N.MAMBA, p.mamba), (N.SWA, p.swa), (N.INDEXER, p.indexer))
                if x is not None]

    def side_pools(self):
        return [x for _, x in self.named_sidecars()]

    # --- keys and indices (built once, outside the timed calls) -------------------
    def keys(self, pages: int, r: int, tag: str = "") -> list[str]:
        k = (pages, r, tag)
        if k not in self._keys:
            self._keys[k] = [f"{self.g['name']}-n{pages}-r{r}{tag}-p{i:05d}" for i in range(pages)]
        return self._keys[k]

    def kv_first(self, region: int, r: int) -> int:
        return (region * self.requests + r) * self.top

    def idx(self, pages: int, r: int, region: int) -> torch.Tensor:
        k = (pages, r, region)
        if k not in self._idx:
            a = self.kv_first(region, r) * self.P
            self._idx[k] = torch.arange(a, a + pages * self.P, dtype=torch.int64)
        return self._idx[k]

    def slot(self, region: int, r: int) -> int:
        return region * self.requests + r

    def sidecars(self, keys, r: int, region: int) -> list:
        """The trailing (non-KV-derived) transfers of one prefix, as SGLang's op carries them."""
        T, N, TRAIL = self.T, self.N, self.H.TRAILING_PAGES
        s = self.slot(region, r)
        if ("side", s) not in self._idx:   # the tensors once: no torch call of ours in a round
            a = s * self.W * self.P
            self._idx["side", s] = (torch.tensor([s]),
                                    torch.arange(a, a + self.W * self.P, dtype=torch.int64))
        slot, window = self._idx["side", s]
        out = []
        if self.pools.mamba is not None:
            out.append(T(name=N.MAMBA, keys=keys[-1:], host_indices=slot, hit_policy=TRAIL))
        if self.pools.swa is not None:
            out.append(T(name=N.SWA, keys=keys[-self.W:], hit_policy=TRAIL, host_indices=window))
        return out

    # --- the controller's calls (run on a storage thread) ------------------------
    def backup(self, pages: int, r: int, fresh: bool = False) -> bool:
        """hybrid_cache_controller._page_backup: the sidecars' batch_set_v2, then
        cache_controller._page_backup: batch_set_v1 per 128-page batch."""
        keys = self.keys(pages, r, f"-t{next(_fresh)}" if fresh else "")
        idx, P, x = self.idx(pages, r, SRC), self.P, self.X(prefix_keys=None)
        side = self.sidecars(keys, r, SRC)
        if self.pools.indexer is not None:
            side.append(self.T(name=self.N.INDEXER, keys=keys, host_indices=idx))
        ok = True
        if side:
            self.calls["batch_set_v2"] += 1
            ok = all(all(v) for v in self.backend.batch_set_v2(side, extra_info=x).values())
        for i in range(0, len(keys), BATCH):
            self.calls["batch_set_v1"] += 1
            bk = keys[i:i + BATCH]
            ok &= all(self.backend.batch_set_v1(bk, idx[i * P:(i + len(bk)) * P], x))
        return ok

    def prefetch(self, pages: int, r: int) -> int:
        """KV pages read (0 if a sidecar missed): _storage_hit_query's batch_exists_v2,
        _page_transfer's batches (batch_get_v1, plus batch_get_v2 of KV-derived
        pools), then _page_transfer_sidecar's batch_get_v2."""
        keys, idx, P = self.keys(pages, r), self.idx(pages, r, DST), self.P
        T, N = self.T, self.N
        side = self.sidecars(keys, r, DST)
        derived = self.pools.indexer is not None
        query = side + ([T(name=N.INDEXER, indices_from_pool=N.KV)] if derived else [])
        self.calls["batch_exists_v2"] += 1
        n = self.backend.batch_exists_v2(keys, query, self.X(prefix_keys=None)).kv_hit_pages
        done = 0
        for i in range(0, n, BATCH):
            bk = keys[i:min(i + BATCH, n)]
            bidx, x = idx[i * P:(i + len(bk)) * P], self.X(prefix_keys=None)
            self.calls["batch_get_v1"] += 1
            res = self.backend.batch_get_v1(bk, bidx, x)
            c = res.index(False) if False in res else len(res)
            if derived:
                self.calls["batch_get_v2"] += 1
                got = self.backend.batch_get_v2([T(name=N.INDEXER, host_indices=bidx, keys=bk)],
                                                extra_info=x)
                c = min([c] + [v.index(False) if False in v else len(v) for v in got.values()])
            done += c
            if c < len(bk):
                return done
        if done == len(keys) and side:
            self.calls["batch_get_v2"] += 1
            got = self.backend.batch_get_v2(side, extra_info=self.X(prefix_keys=None))
            if not all(all(v) for v in got.values()):
                return 0
        return done

    # --- the bytes ------------------------------------------------------------------
    def _views(self, region: int, r: int, pages: int):
        """(pool label, [tensor views of the pages]) for every pool of one prefix."""
        p, a, s = self.pools, self.kv_first(region, r), self.slot(region, r)
        kv = p.kv.kv_buffer
        # page_first_direct: MLA (pages, layers, P, 1, dim), MHA (2, pages, layers, P, H, D)
        out = [("kv", [kv[a:a + pages]] if self.g["kv"] == "mla" else [kv[:, a:a + pages]])]
        if p.indexer is not None:
            out.append(("indexer", [p.indexer.index_k_with_scale_buffer[a:a + pages]]))
        if p.mamba is not None:
            out.append(("mamba", [p.mamba.temporal_buffer[s:s + 1],
                                  *[c[s:s + 1] for c in p.mamba.conv_buffer]]))
        if p.swa is not None:
            out.append(("swa", [p.swa.kv_buffer[:, s * self.W:(s + 1) * self.W]]))
        return out

    def clear_dst(self, pages: int) -> None:
        if self.kind == "nobytes":
            return
        for r in range(self.requests):
            for _, views in self._views(DST, r, pages):
                for v in views:
                    v.zero_()

    def check(self, pages: int) -> None:
        """Counts every KV and sidecar page of the last run against what was written."""
        if self.kind == "nobytes":
            return
        for r in range(self.requests):
            pairs = zip(self._views(DST, r, pages), self._views(SRC, r, pages))
            for (label, dst), (_, src) in pairs:
                n = {"kv": pages, "indexer": pages, "mamba": 1, "swa": self.W}[label]
                self.checked += n
                if all(torch.equal(d.view(torch.uint8), s.view(torch.uint8))
                       for d, s in zip(dst, src)):
                    continue
                axis = 1 if label == "swa" or (label == "kv" and self.g["kv"] != "mla") else 0
                for i in range(n):
                    self.wrong += not all(torch.equal(d.narrow(axis, i, 1).view(torch.uint8),
                                                      s.narrow(axis, i, 1).view(torch.uint8))
                                          for d, s in zip(dst, src))

    def round_bytes(self, pages: int) -> int:
        """Bytes one prefetch of `pages` KV pages moves, sidecars included."""
        return sum(v.numel() * v.element_size() for _, views in self._views(SRC, 0, pages)
                   for v in views)

    def page_bytes(self) -> dict:
        return {label: sum(v.numel() * v.element_size() for v in views)
                for label, views in self._views(SRC, 0, 1)}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if hasattr(self.backend, "close"):
                self.backend.close()
