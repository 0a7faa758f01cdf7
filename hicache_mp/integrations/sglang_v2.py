"""SGLang's v2 storage interface (hybrid models) for the HiCacheMP backend.

Owns the sidecar host pools a hybrid model registers through
`register_mem_host_pool_v2` (Mamba state, SWA window, DSA indexer, DeepSeek V4
compressed pools, draft pools), the per-pool hit policies of `batch_exists_v2`
and the page moves of `batch_get_v2` / `batch_set_v2`. Must not touch the KV
pool's own engine beyond asking the backend for KV presence and v1 I/O.

Each sidecar pool gets its own engine: a batch is one engine op per pool.
Where the pool's tensors are memfds ("allocator": "shm") the workers map
every memfd and read/write its pages in place (zero-copy, as for KV;
shm.partpool): a page is a few runs of them (one per tensor of a Mamba
state, K and V, or one per K/V and layer). The scheduler's process then
makes no torch call per page or component, only one index conversion per
batch and the wait. Every torch call releases the GIL, and with a busy
scheduler thread each release can cost a switch interval (5 ms) to get it
back. Otherwise (SGLang's default allocator) they go through an
engine-owned shared-memory staging pool, and the pages move between it and
SGLang's pool with a few batched torch copies per component
(`sglang_sidecar`), never a Python loop over pages where the layout is known.

Page identity: the key is `{hash}.{pool}` as in SGLang's `file` backend, and
the engine's namespace holds the pool name and the page's byte layout, so the
header's key digest ties a file to one pool and one geometry: a file of one
pool can never be read as another's. Mamba keys always carry the TP rank (its
state is TP-sharded even when the model's MLA KV is replicated); the other
pools follow the KV rule (no TP rank under MLA).

Hit policies follow SGLang 0.5.23's `HiCacheFile.batch_exists_v2`:
ALL_PAGES (every page of the KV prefix), TRAILING_PAGES (the last N pages of
a prefix; the restorable prefixes are a set), and BLOCK_GROUPS (not decided
by any 0.5.23 backend; here as its docstring says: the pages covered by the
leading complete groups of `group_pages` keys, `block_pages` pages per group,
reported as the pool's verdict, never gating the KV hit).
"""
from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import torch

from shm import PageGeometry
from workers import status as st

from ..engine import PrefetchEngine
from . import sglang_sidecar

log = logging.getLogger("hicache_mp.sglang")

KV = "kv"
MAMBA = "mamba"
SIDECAR_STAGING_BYTES = 64 << 20   # staging memory per sidecar pool (at least one page)
SIDECAR_STAGING_PAGES = 256
SIDECAR_WORKERS = 2


def pool_name(name) -> str:
    """PoolName enum or str -> its value ('mamba', 'swa', ...)."""
    return str(getattr(name, "value", name))


def policy_name(policy) -> str:
    return str(getattr(policy, "value", policy))


def _as_numpy(indices) -> np.ndarray:
    """Host indices as a numpy array: on a CPU tensor (SGLang's host indices
    are) one `.numpy()`, a view that releases no GIL; no `.cpu()` or `.to()`,
    each of which would."""
    if isinstance(indices, torch.Tensor):
        if indices.device.type != "cpu":
            indices = indices.cpu()
        return indices.numpy()
    return np.asarray(indices)


class _Slots:
    """Free staging slots of one sidecar engine."""

    def __init__(self, n: int):
        self.free = list(range(n))
        self.cap = n
        self.cond = threading.Condition()

    def take(self, n: int) -> list[int]:
        with self.cond:
            while not self.free:
                self.cond.wait()
            n = min(n, len(self.free))
            out, self.free = self.free[:n], self.free[n:]
            return out

    def give(self, slots) -> None:
        with self.cond:
            self.free.extend(slots)
            self.free.sort()
            self.cond.notify_all()


class SidecarPool:
    """One registered sidecar pool: its layout, engine and staging slots."""

    def __init__(self, name: str, host_pool, layout, engine: PrefetchEngine, zero_copy: bool,
                 probe_wait_s: float = 0.0, parts: int = 0):
        self.probe_wait_s = probe_wait_s
        self.name, self.host_pool, self.layout, self.engine = name, host_pool, layout, engine
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        self.zero_copy = zero_copy
        self.parts = parts          # runs per page in the mapped memfds (zero-copy)
        pages = engine.config.host_pool_pages
        self.staging = None if zero_copy else \
            engine.host_pool.tensor.view(torch.uint8).reshape(pages, layout.page_bytes)
        self.slots = None if zero_copy else _Slots(pages)

    def key(self, key: str) -> str:
        return f"{key}.{self.name}"

    def present(self, keys) -> np.ndarray:
        """Per key: its page is in the store. Keys the index misses are asked of
        the workers, as for KV (hicache_mp.discovery): another process sharing
        the directory may have written them, and no stat runs in this process."""
        eng = self.engine
        skeys = [self.key(k) for k in keys]
        out = eng.present(skeys)
        if not out.all():
            eng.ask(skeys, wait_s=self.probe_wait_s)
            out = eng.present(skeys)
        return out

    def _stage(self, slots: list[int]):
        s0 = slots[0]
        if slots == list(range(s0, s0 + len(slots))):
            return self.staging[s0:s0 + len(slots)], None
        return torch.empty(len(slots), self.layout.page_bytes, dtype=torch.uint8), \
            torch.tensor(slots, dtype=torch.int64)

    def _pages(self, index: np.ndarray) -> np.ndarray:
        return index // self.page_size

    def read(self, keys, index: np.ndarray, wait) -> list[bool]:
        """Read pages into the host pool; only the leading run of landed pages counts.
        `index`: each page's first host index (numpy int64)."""
        if self.zero_copy:
            op = self.engine.prefetch([self.key(k) for k in keys], self._pages(index),
                                      policy="wait_complete")
            wait(self.engine, op)
            return [i < op.completed_pages for i in range(len(keys))]
        index = torch.from_numpy(index)
        done = 0
        while done < len(keys):
            slots = self.slots.take(len(keys) - done)
            n = len(slots)
            try:
                op = self.engine.prefetch([self.key(k) for k in keys[done:done + n]], slots,
                                          policy="wait_complete")
                wait(self.engine, op)
                ok = int(op.completed_pages)
                if ok:
                    src = self.staging[torch.tensor(slots[:ok], dtype=torch.int64)]
                    self.layout.scatter(index[done:done + ok], src)
            finally:
                self.slots.give(slots)
            done += ok
            if ok < n:
                break
        return [i < done for i in range(len(keys))]

    def write(self, keys, index: np.ndarray, wait) -> list[bool]:
        """Write pages not yet stored; per key whether its page is in the store."""
        ok = self.present(keys)
        todo = np.flatnonzero(~ok)
        if self.zero_copy and len(todo):
            op = self.engine.backup([self.key(keys[i]) for i in todo], self._pages(index[todo]))
            wait(self.engine, op)
            ok[todo] = op.page_status == st.OK
            return ok.tolist()
        index = torch.from_numpy(index)
        pos = 0
        while pos < len(todo):
            slots = self.slots.take(len(todo) - pos)
            n = len(slots)
            part = todo[pos:pos + n]
            try:
                buf, rows = self._stage(slots)
                self.layout.gather(index[torch.from_numpy(part)], buf)
                if rows is not None:
                    self.staging.index_copy_(0, rows, buf)
                op = self.engine.backup([self.key(keys[i]) for i in part], slots)
                wait(self.engine, op)
                ok[part] = op.page_status == st.OK
            finally:
                self.slots.give(slots)
            pos += n
        return ok.tolist()

    def close(self) -> None:
        self.staging = None
        self.engine.close()


class HybridPools:
    """The v2 side of HiCacheMP: sidecar pools, hit policies, batch get/set."""

    def __init__(self, backend):
        self.backend = backend       # HiCacheMP: KV presence, v1 I/O, engine config, waits
        self.pools: dict[str, SidecarPool] = {}
        self.unserved: dict[str, str] = {}
        self.kv_names: set[str] = set()
        self._lock = threading.Lock()

    # --- registration ------------------------------------------------------------
    def register(self, host_pool, host_pool_name) -> None:
        """Serve `host_pool` (also later at runtime; a second registration of a
        name replaces the first). Never raises: a pool that cannot be served is
        logged and answers "not stored" (False / no restorable prefix), so
        SGLang's attach never fails half-way with its threads started."""
        name = pool_name(host_pool_name)
        if name == KV or host_pool is self.backend.mem_pool_host:
            self.kv_names.add(name)
            return
        with self._lock:
            old = self.pools.pop(name, None)
            self.unserved.pop(name, None)
        if old is not None:
            old.close()
        engine = None
        try:
            layout = sglang_sidecar.plan(host_pool)
            parts, pages, why = sglang_sidecar.zero_copy_parts(host_pool, layout)
            if parts is not None and not self.backend.own.zero_copy:
                parts, why = None, '"zero_copy": false in the extra-config'
            engine = PrefetchEngine(self._config(name, layout, pages if parts else 0),
                                    self._geometry(layout), pool_parts=parts,
                                    aux_workers=SIDECAR_WORKERS)
            pool = SidecarPool(name, host_pool, layout, engine, zero_copy=parts is not None,
                               probe_wait_s=self.backend.own.probe_wait_s,
                               parts=len(parts or ()))
        except Exception as exc:
            if engine is not None:
                engine.close()
            with self._lock:
                self.unserved[name] = f"{type(exc).__name__}: {exc}"
            log.warning("hicache_mp: sidecar pool %r is not served (%s); its pages read as "
                        "missing and its writes fail, so no prefix that needs it is restored",
                        name, exc)
            return
        with self._lock:
            self.pools[name] = pool
        log.info("hicache_mp: sidecar pool %r: %s, %d-byte pages, %s, %d workers", name,
                 layout.kind, layout.page_bytes,
                 ("zero-copy, %d runs per page" % pool.parts) if pool.zero_copy else
                 ("staged, batched copies (%s)" % why) if layout.batched else
                 "staged, page-by-page copies", engine.worker_count())

    @staticmethod
    def _geometry(layout) -> PageGeometry:
        # Opaque bytes (the byte meaning is in the namespace). Only the page size
        # and the fingerprint count: where the pages lie in a zero-copy pool is
        # its parts' business (shm.partpool), and a staging pool is page_first
        # in the same flat order, so a page written zero-copy reads staged and
        # back. (K/V tensors keep their 2-run geometry: its fingerprint names
        # the files already stored.)
        if layout.kv_runs == 2:
            return PageGeometry(num_layers=1, num_kv_heads=1, head_dim=layout.page_bytes // 2,
                                page_size=1, dtype="uint8", layout="page_first")
        return PageGeometry(num_layers=1, num_kv_heads=1, head_dim=layout.page_bytes,
                            page_size=1, dtype="uint8", layout="page_first", mla=True)

    def _config(self, name: str, layout, pool_pages: int = 0):
        b = self.backend
        pages = pool_pages or max(1, min(SIDECAR_STAGING_PAGES,
                                         SIDECAR_STAGING_BYTES // layout.page_bytes))
        cfg = b._config(pages)
        names = {}
        if name == MAMBA:   # TP-sharded even when the KV is MLA (replicated)
            names = {"tp_rank": b.shard.tp_rank, "tp_size": b.shard.tp_size}
        # auto (0): up to SIDECAR_WORKERS from the node's budget, as an auxiliary
        # of this rank's KV engine (aux_workers)
        workers = min(SIDECAR_WORKERS, cfg.num_workers) if cfg.num_workers else 0
        return dataclasses.replace(
            cfg, num_workers=workers, **names,
            namespace_extra=f"{cfg.namespace_extra}|pool={name}|{layout.describe()}")

    # --- batch_exists_v2 -----------------------------------------------------------
    def _has(self, name: str, keys, kv_present: np.ndarray) -> np.ndarray:
        if name == KV or name in self.kv_names:
            return kv_present[:len(keys)]
        pool = self.pools.get(name)
        if pool is None:
            return np.zeros(len(keys), dtype=bool)
        return pool.present(keys)

    def exists(self, keys, pool_transfers, result_cls):
        keys = list(keys)
        kv_pages = self.backend.batch_exists(keys)
        kv_present = np.arange(len(keys)) < kv_pages
        hit_count: dict = {KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            name, policy = pool_name(t.name), policy_name(t.hit_policy)
            has = self._has(name, keys[:kv_pages], kv_present)
            if policy == "all_pages":
                boundary = int(np.argmin(has)) if not has.all() else kv_pages
                pool_restorable = set(range(1, boundary + 1))
            elif policy == "trailing_pages":
                trailing = max(1, len(t.keys) if t.keys else 1)
                # prefix p is restorable iff pages [p-trailing, p) are all present
                run = np.zeros(kv_pages + 1, dtype=np.int64)
                for i in range(kv_pages):
                    run[i + 1] = run[i] + 1 if has[i] else 0
                pool_restorable = {p for p in range(1, kv_pages + 1)
                                   if run[p] >= min(trailing, p)}
                boundary = max(pool_restorable, default=0)
            elif policy == "block_groups":
                boundary = self._block_groups(t, name, keys, kv_pages, kv_present)
                if boundary:
                    hit_count[t.name] = boundary
                continue  # a verdict of its own; never gates the KV hit
            else:
                raise ValueError(f"hicache_mp: unsupported pool hit policy {t.hit_policy!r}")
            if boundary:
                hit_count[t.name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        final = restorable[-1] if restorable else 0
        return result_cls(final, hit_count, restorable)

    def _block_groups(self, t, name, keys, kv_pages, kv_present) -> int:
        group, block = int(t.group_pages or 0), int(t.block_pages or 0)
        if group <= 0 or block <= 0:
            raise ValueError(f"hicache_mp: BLOCK_GROUPS transfer {name!r} needs positive "
                             f"group_pages and block_pages, got {group} and {block}")
        gkeys = list(t.keys) if t.keys else keys[:kv_pages]
        full = len(gkeys) // group
        has = self._has(name, gkeys[:full * group], kv_present)
        groups = 0
        while groups < full and has[groups * group:(groups + 1) * group].all():
            groups += 1
        return min(groups * block, kv_pages)

    # --- batch_get_v2 / batch_set_v2 ---------------------------------------------
    def io(self, transfers, *, write: bool) -> dict:
        """{pool name: [bool per key]}, exactly len(keys) entries each; a pool
        that is missing, unserved or given mismatched indices answers False."""
        out = {}
        for t in transfers:
            name = pool_name(t.name)
            keys = list(t.keys or [])
            if not keys:
                out[t.name] = []
                continue
            if name == KV or name in self.kv_names:
                fn = self.backend.batch_set_v1 if write else self.backend.batch_get_v1
                out[t.name] = list(fn(keys, t.host_indices))
                continue
            pool = self.pools.get(name)
            idx = None if t.host_indices is None else _as_numpy(t.host_indices)
            if pool is None or idx is None or idx.size != len(keys) * pool.page_size:
                log.error("hicache_mp: %s v2 transfer for pool %r: %s", "set" if write else
                          "get", name, "pool not served" if pool is None else
                          f"{len(keys)} keys need {len(keys) * pool.page_size} host indices, "
                          f"got {0 if idx is None else idx.size}")
                out[t.name] = [False] * len(keys)
                continue
            index = idx.reshape(-1)[::pool.page_size].astype(np.int64)
            if pool.zero_copy and (index % pool.page_size).any():
                # zero-copy moves whole pages: a page that does not start on a page
                # boundary would be read into (or written from) the wrong one
                log.error("hicache_mp: %s v2 transfer for pool %r: a page's host indices "
                          "do not start on a page boundary", "set" if write else "get", name)
                out[t.name] = [False] * len(keys)
                continue
            fn = pool.write if write else pool.read
            out[t.name] = fn(keys, index, self.backend._wait_on)
        return out

    # --- housekeeping ---------------------------------------------------------------
    def engines(self) -> list[PrefetchEngine]:
        return [p.engine for p in self.pools.values()]

    def metrics(self) -> dict:
        return {"sidecar_pools": {n: {"layout": p.layout.describe(),
                                      "zero_copy": p.zero_copy,
                                      "parts": p.parts,
                                      "batched": p.layout.batched,
                                      "page_bytes": p.layout.page_bytes,
                                      "workers": p.engine.worker_count()}
                                  for n, p in self.pools.items()},
                "sidecar_unserved": dict(self.unserved)}

    def close(self) -> None:
        with self._lock:
            pools, self.pools = list(self.pools.values()), {}
            self.unserved, self.kv_names = {}, set()
        for p in pools:
            p.close()
