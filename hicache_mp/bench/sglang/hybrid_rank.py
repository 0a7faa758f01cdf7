"""One rank of scripts/sglang_hybrid_check.py: SGLang's real hybrid host pools
and HybridCacheController (hicache_mp/bench/sglang/hybrid_controller.py: what is
SGLang's and what is stood in) on one backend, and the scheduler's side of
a backup and of a prefetch round, as SGLang 0.5.23's UnifiedRadixCache
plays it in the cache host-memory mode.

Backup (`write_backup_storage`): per request one `write_storage` of its KV
host pages and hashes, with the transfers the components build for
BACKUP_STORAGE (Mamba: the state slot keyed by the last hash; SWA: the
window's pages keyed by the last hashes; both TRAILING_PAGES) and the DSA
indexer's sidecar transfer (indices from KV); then the acks from
`ack_backup_queue`. The controller's backup thread makes the calls
(`batch_set_v2`, then `batch_set_v1` per 128 pages).

Prefetch round (`prefetch_from_storage` and the hit drain): `requests`
`controller.prefetch` calls, each with its own token ids and the PREFETCH
transfers (placeholder keys for Mamba and SWA, the indexer's sidecar),
all submitted before any wait; then per hit from `prefetch_hit_queue`
`allocate_storage_hit` (the KV staging) and the components' staging of
each sidecar (`alloc` on its host pool), `prefetch_buffer.put`; then
`ack_prefetch_queue` until every request is complete. The calls
(`batch_exists_v2`, `batch_get_v1` and `batch_get_v2` per 128-page batch
and of the sidecars) are the controller's threads'. Waits go through the
caller's scheduler object (scripts/sglang_stack.py's `Scheduler`). Not
played: the radix tree (no insert after a round: its staging is checked
and freed), the prefetch rate limiter and host eviction (the pools are
sized so that a round always fits).

Bytes: mp's `src` host pages (random, backed up) are allocated once; the
rest of each pool is zeroed. After a round every KV and sidecar page read
is compared with its `src` page, then zeroed and freed. The no-bytes
floor's pools hold only the staging its rounds allocate (its backups name
host slots it never reads). Owns no engine logic; the backend is built
only by SGLang's factory (the dynamic config names
`hicache_mp.integrations.sglang`.HiCacheMP or hicache_mp/bench/sglang/nobytes.py).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import os
import sys
import threading
import time
from array import array

import torch

from hicache_mp.bench.sglang import hybrid_controller as HC
from hicache_mp.bench.sglang import real as sglang_real
from hicache_mp.bench.sglang import real_hybrid as RH

COUNTED = ("batch_exists", "batch_exists_v2", "batch_get_v1", "batch_get_v2", "batch_set_v1",
           "batch_set_v2")
# On CUDA every host pool is cudaHostRegister'ed and nothing unregisters it:
# freeing one lets the next pools be mapped at the same address, and
# registering that range again fails (cudaError 712). They live until exit.
_KEEP_POOLS: list = []
_ids = itertools.count(1)


def _same(t, axis: int, a: int, b: int, n: int) -> bool:
    """Pages a.. and b.. (n of them) of `t` hold the same bytes (NaN payloads too)."""
    return torch.equal(t.narrow(axis, a, n).view(torch.uint8),
                       t.narrow(axis, b, n).view(torch.uint8))


class Rank:
    def __init__(self, S, g: dict, kind: str, store: str, *, requests: int, max_pages: int,
                 workers: int):
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.radix_cache import RadixKey
        self.T, self.N, self.TRAIL = PoolTransfer, PoolName, PoolHitPolicy.TRAILING_PAGES
        self.hash, self.Handle, self.Key = get_storage_hash_str, CacheRequestHandle, RadixKey
        self.kind, self.g, self.requests, self.top = kind, g, requests, max_pages
        self.P, self.W = g["page_size"], g.get("window_pages", 2)
        if kind not in ("mp", "nobytes", "sleeping"):
            raise ValueError(f"unknown backend {kind!r} (mp, nobytes, sleeping)")
        n = 2 if kind == "mp" else 1   # mp: src and staging; the floor: staging only
        self.pools = RH.hybrid_pools(S, g, kv_pages=n * requests * max_pages,
                                     prefixes=n * requests)
        _KEEP_POOLS.append(self.pools)
        if kind == "mp":
            extra = sglang_real.mp_extra(store, num_workers=workers)
            self._fill_src()
        else:   # slots its backups name and it never reads
            extra = (sglang_real.nobytes_extra("Sleeping", "sleeping") if kind == "sleeping"
                     else sglang_real.nobytes_extra())
            self.src = {"kv": torch.arange(requests * max_pages * self.P),
                        "mamba": torch.arange(requests),
                        "swa": torch.arange(requests * self.W * self.P)}
        self.group, self.ctl = HC.build(self.pools, g, backend="dynamic", extra=extra,
                                        model=f"hicache-mp/{g['name']}")
        self.backend = self.ctl.storage_backend
        self.calls = collections.Counter()    # backend calls SGLang's threads made, by name
        self.empty_v2 = collections.Counter()  # of which batch_get_v2 / set_v2 with no transfer
        self._count_calls()
        self.wrong = self.checked = 0
        self._keys = {}

    # --- setup -------------------------------------------------------------------
    def _fill_src(self) -> None:
        """Random bytes in `src` (allocated now, for good), zeros in the rest."""
        gen = torch.Generator().manual_seed(11)
        p, R, top, P = self.pools, self.requests, self.top, self.P
        for pool in (p.kv, p.mamba, p.swa, p.indexer):
            if pool is not None:
                RH.fill_words(pool, gen)
        self.src = {"kv": p.kv.alloc(R * top * P)}
        if p.mamba is not None:
            self.src["mamba"] = p.mamba.alloc(R)
        if p.swa is not None:
            self.src["swa"] = p.swa.alloc(R * self.W * P)
        for label, pool in (("kv", p.kv), ("mamba", p.mamba), ("swa", p.swa)):
            if pool is not None:
                rest = pool.alloc(pool.available_size())
                self._zero(label, rest)
                pool.free(rest)

    def _count_calls(self) -> None:
        """Counts SGLang's calls into the backend, not the backend's into itself
        (HiCacheMP's batch_exists_v2 asks its own batch_exists)."""
        be, inside = self.backend, threading.local()
        for name in COUNTED:
            fn = getattr(be, name, None)
            if fn is None:
                continue

            def wrap(*a, _fn=fn, _name=name, **k):
                if getattr(inside, "call", False):
                    return _fn(*a, **k)
                self.calls[_name] += 1
                if _name in ("batch_get_v2", "batch_set_v2") and not a[0]:
                    self.empty_v2[_name] += 1
                inside.call = True
                try:
                    return _fn(*a, **k)
                finally:
                    inside.call = False
            setattr(be, name, wrap)

    # --- keys (built once, outside the timed calls) --------------------------------
    def prefix(self, pages: int, r: int, fresh: bool = False):
        """(RadixKey, storage hashes) of request r's prefix of `pages` pages."""
        k = (pages, r, next(_ids) if fresh else 0)
        if k not in self._keys:
            first = next(_ids) * (self.top + 1) * self.P
            key = self.Key(array("q", range(first, first + pages * self.P)))
            self._keys[k] = (key, self.hash(key, None, page_size=self.P))
        return self._keys[k]

    def src_of(self, r: int, pages: int) -> dict:
        a, w = r * self.top * self.P, r * self.W * self.P
        out = {"kv": self.src["kv"][a:a + pages * self.P]}
        if self.pools.mamba is not None:
            out["mamba"] = self.src["mamba"][r:r + 1]
        if self.pools.swa is not None:
            out["swa"] = self.src["swa"][w:w + self.W * self.P]
        return out

    # --- the scheduler's side --------------------------------------------------------
    def backup(self, pages: int, sched, timeout_s: float, fresh: bool = False) -> bool:
        """Every request's prefix written through the controller; True if all completed."""
        T, N, ids = self.T, self.N, {}
        for r in range(self.requests):
            key, hashes = self.prefix(pages, r, fresh)
            src = self.src_of(r, pages)
            aux = []
            if self.pools.mamba is not None:
                aux.append(T(name=N.MAMBA, host_indices=src["mamba"], keys=hashes[-1:],
                             hit_policy=self.TRAIL))
            if self.pools.swa is not None:
                aux.append(T(name=N.SWA, host_indices=src["swa"], keys=hashes[-self.W:],
                             hit_policy=self.TRAIL))
            if self.pools.indexer is not None:
                aux.append(T(name=N.INDEXER, keys=hashes, indices_from_pool=N.KV))
            ids[self.ctl.write_storage(src["kv"], list(key.token_ids), hashes, None,
                                       extra_pools=aux or None)] = pages * self.P
        deadline, ok = time.monotonic() + timeout_s, True
        for _ in range(self.requests):
            op = sched.get(self.ctl.ack_backup_queue, deadline)
            ok &= op.completed_tokens == ids.pop(op.id)
        return ok and not ids

    def _prefetch_transfers(self) -> list:
        T, N, out = self.T, self.N, []
        if self.pools.mamba is not None:
            out.append(T(name=N.MAMBA, keys=["__placeholder__"], hit_policy=self.TRAIL))
        if self.pools.swa is not None:
            out.append(T(name=N.SWA, keys=["__placeholder__"] * self.W, hit_policy=self.TRAIL))
        if self.pools.indexer is not None:
            out.append(T(name=N.INDEXER, indices_from_pool=N.KV))
        return out

    def prefetch(self, pages: int, sched, timeout_s: float):
        """One round: (seconds, {rid: (request, operation, KV tokens completed)})."""
        ctl, deadline = self.ctl, time.monotonic() + timeout_s
        keys = [self.prefix(pages, r)[0] for r in range(self.requests)]
        rids = {}
        t0 = time.perf_counter()
        for r, key in enumerate(keys):
            handle = self.Handle(rid=f"{self.kind}-{next(_ids)}", attempt_id=0)
            rids[handle.rid] = r
            ctl.prefetch(handle, key, None, None, extra_pools=self._prefetch_transfers() or None)
        out, staged = {}, 0
        for _ in keys:
            op = sched.get(ctl.prefetch_hit_queue, deadline)
            out[op.request_id] = [rids[op.request_id], op, 0]
            staged += self._stage(op)
        while staged:
            ack = sched.get(ctl.ack_prefetch_queue, deadline)
            if ack.completed_tokens is not None:
                out[ack.rid][2] = ack.completed_tokens
            staged -= bool(ack.completed_req)
        return time.perf_counter() - t0, out

    def _stage(self, op) -> bool:
        """The hit drain's allocation: KV staging, each sidecar's, then the I/O queue."""
        ctl, hit = self.ctl, op.storage_hit_count
        if op.is_terminated() or hit < ctl.prefetch_threshold:
            return False
        host, n = ctl.allocate_storage_hit(op, hit, allow_partial=True,
                                           min_tokens=ctl.prefetch_threshold,
                                           evict_host=lambda tokens: 0)  # no tree to evict
        if host is None:
            return False
        for t in op.pool_transfers or ():
            if t.host_indices is None and not t.indices_from_pool:
                pool = self.group.get_pool(t.name)
                t.host_indices = pool.alloc(min(len(t.keys), n // self.P) * pool.page_size)
        op.storage_hit_count, op.hash_value, op.host_indices = n, op.hash_value[:n // self.P], host
        ctl.prefetch_buffer.put(op)
        return True

    def finish(self, pages: int, out: dict, label: str) -> None:
        """Checks (mp) and frees a round's staging; raises on a short read."""
        done = sorted((r, tokens // self.P) for r, _, tokens in out.values())
        try:
            if self.kind == "mp":
                for r, op, _ in out.values():
                    self._check(op, r, pages)
        finally:
            for _, op, _ in out.values():
                if op.host_indices is not None:
                    self.group.free(op.host_indices)
                for t in op.pool_transfers or ():
                    if t.host_indices is not None and not t.indices_from_pool:
                        self.group.get_pool(t.name).free(t.host_indices)
        if done != [(r, pages) for r in range(self.requests)]:
            raise AssertionError(f"{label}: (request, pages) read {done}, wanted {pages} each")

    # --- the bytes ------------------------------------------------------------------
    def _pages(self, label: str, idx) -> list[int]:
        step = 1 if label == "mamba" else self.P
        return [int(i) // step for i in idx[::step]]

    def _buffers(self, label: str):
        """(tensor, page axis) of every buffer of a pool (page_first_direct layouts)."""
        p = self.pools
        if label == "kv":
            return [(p.kv.kv_buffer, 0 if self.g["kv"] == "mla" else 1)]
        if label == "indexer":
            return [(p.indexer.index_k_with_scale_buffer, 0)]
        if label == "swa":
            return [(p.swa.kv_buffer, 1)]
        return [(p.mamba.temporal_buffer, 0)] + [(c, 0) for c in p.mamba.conv_buffer]

    @staticmethod
    def _runs(d: list, s: list):
        """(dst page, src page, pages) runs where both go up by one: one view each."""
        i = 0
        while i < len(d):
            j = i + 1
            while j < len(d) and d[j] == d[j - 1] + 1 and s[j] == s[j - 1] + 1:
                j += 1
            yield d[i], s[i], j - i
            i = j

    def _zero(self, label: str, idx) -> None:
        labels = [label] + (["indexer"] if label == "kv" and self.pools.indexer else [])
        for lb in labels:
            pages = self._pages(lb, idx)
            for t, axis in self._buffers(lb):
                for a, _, n in self._runs(pages, pages):
                    t.narrow(axis, a, n).zero_()

    def _check(self, op, r: int, pages: int) -> None:
        """Counts every page of request r's round against its src page, then zeroes it."""
        src = self.src_of(r, pages)
        dst = {"kv": op.host_indices}
        for t in op.pool_transfers or ():
            if not t.indices_from_pool:
                dst[t.name.value] = t.host_indices
        pairs = [("kv", "kv")] + ([("indexer", "kv")] if self.pools.indexer is not None else [])
        pairs += [(lb, lb) for lb in ("mamba", "swa") if lb in src]
        for label, via in pairs:
            d, s = self._pages(via, dst[via]), self._pages(via, src[via])
            self.checked += len(s)
            bad = set(range(len(d), len(s)))   # pages never staged
            for t, axis in self._buffers(label):
                k = 0
                for a, b, n in self._runs(d, s[:len(d)]):
                    if not _same(t, axis, a, b, n):
                        bad |= {k + i for i in range(n) if not _same(t, axis, a + i, b + i, 1)}
                    k += n
            self.wrong += len(bad)   # a page counts once, whichever buffer differs
            for t, axis in self._buffers(label):
                for a, _, n in self._runs(d, d):
                    t.narrow(axis, a, n).zero_()

    def round_bytes(self, pages: int) -> int:
        """Bytes one request of `pages` KV pages moves, sidecars included."""
        b = self.page_bytes()
        return pages * (b["kv"] + b.get("indexer", 0)) + b.get("mamba", 0) + \
            self.W * b.get("swa", 0)

    def page_bytes(self) -> dict:
        out = {}
        for label in ("kv", "indexer", "mamba", "swa"):
            if label == "kv" or getattr(self.pools, label) is not None:
                out[label] = sum(t.narrow(axis, 0, 1).numel() * t.element_size()
                                 for t, axis in self._buffers(label))
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ctl.detach_storage_backend()   # stops SGLang's threads, closes the backend
