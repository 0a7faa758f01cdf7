"""SGLang's v2 storage interface (hybrid models): the sidecar pools of a HiCacheMP backend.

Owns the sidecar host pools a hybrid model registers through
`register_mem_host_pool_v2` (Mamba state, SWA window, DSA indexer, DeepSeek V4
compressed pools, draft pools): one engine each, and the page moves of
`batch_get_v2` / `batch_set_v2`; `batch_exists_v2`'s answer is `hits`'. Must
not touch the KV pool's own engine beyond asking the backend for KV presence
and its v1 KV batches.

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
(`sidecar_layouts`), never a Python loop over pages where the layout is known.

Refused at attach (`SidecarRefused`, raised after every engine of the
backend is closed): a known pool that cannot be served, such as a staged
pool whose page is larger than `sidecar_staging_bytes` or one whose engine
does not fit in /dev/shm. Serving the KV pool without it would write KV
pages for prefixes that can never be restored (SGLang restores a hybrid
prefix only with its sidecar pages). An object that is no host pool we know
is left unserved, and while any pool is unserved no KV page is written
through the v2 calls, for the same reason.

Checksums: every sidecar engine writes a payload CRC and requires it on read
(`sidecar_checksum`, on by default): one flipped byte in a recurrent state
would spoil every later token of a request, and a bad page is a miss.

Page identity: the key is `{hash}.{pool}` as in SGLang's `file` backend, and
the engine's namespace holds the pool name and the page's byte layout, so the
header's key digest ties a file to one pool and one geometry: a file of one
pool can never be read as another's. Mamba keys always carry the TP rank (its
state is TP-sharded even when the model's MLA KV is replicated); the other
pools follow the KV rule (no TP rank under MLA).
"""
from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np

from shm import PageGeometry

from ...engine import PrefetchEngine
from ..common import wait_or_abandon
from . import hits, sidecar_layouts
from .hits import KV, MAMBA, pool_name
from .indices import as_numpy, page_index, page_starts
from .sidecar import SidecarPool

log = logging.getLogger("hicache_mp.sglang")
MIB = 1 << 20


class SidecarRefused(ValueError):
    """A sidecar pool SGLang registered cannot be served: its message names the
    pool, the sizes and the fixes."""


def staging_fixes(page_bytes: int) -> str:
    need = -(-page_bytes // MIB)
    return (f'raise "sidecar_staging_bytes" in --hicache-storage-backend-extra-config to at '
            f'least "{need}M" (and give /dev/shm that much more room: docker --shm-size, the '
            f'emptyDir sizeLimit), or use SGLang\'s shm allocator ("allocator": "shm" in the '
            f'extra-config) so the pool is read and written in place, with no staging')

SIDECAR_STAGING_PAGES = 256
SIDECAR_WORKERS = 2


class HybridPools:
    """The v2 side of HiCacheMP: sidecar pools, batch_exists_v2 (by `hits`), batch get/set."""

    def __init__(self, backend):
        self.backend = backend       # HiCacheMP: KV presence, KV batches, engine config, io_timeout_s
        self.pools: dict[str, SidecarPool] = {}
        self.unserved: dict[str, str] = {}
        self.kv_names: set[str] = set()
        self._lock = threading.Lock()

    # --- registration ------------------------------------------------------------
    def register(self, host_pool, host_pool_name) -> None:
        """Serve `host_pool` (also later at runtime; a second registration of a
        name replaces the first). Never raises: a pool that cannot be served is
        logged and answers "not stored" (False / no restorable prefix), so
        SGLang's attach never fails half-way with its threads started.
        Raises SidecarRefused for a pool of a known layout that cannot be
        served (module docstring); the caller closes the backend."""
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
            layout = sidecar_layouts.plan(host_pool)
        except Exception as exc:
            with self._lock:
                self.unserved[name] = f"{type(exc).__name__}: {exc}"
            log.warning("hicache_mp: sidecar pool %r is not served (%s); its pages read as "
                        "missing and its writes fail, so no prefix that needs it is restored, "
                        "and no KV page is written through the v2 calls", name, exc)
            return
        try:
            parts, pages, why = sidecar_layouts.zero_copy_parts(host_pool, layout)
            if parts is not None and not self.backend.own.zero_copy:
                parts, why = None, '"zero_copy": false in the extra-config'
            cap = self.backend.own.sidecar_staging_bytes
            if parts is None and layout.page_bytes > cap:
                raise SidecarRefused(
                    f"hicache_mp: SGLang's {name} pool has pages of "
                    f"{layout.page_bytes / MIB:.1f} MiB ({layout.page_bytes} bytes), larger than "
                    f"the sidecar staging cap of {cap / MIB:.1f} MiB it must be staged through "
                    f"({why}). Without it no prefix of this model can be restored, so the "
                    f"backend is refused. Fix: {staging_fixes(layout.page_bytes)}")
            engine = PrefetchEngine(self._config(name, layout, pages if parts else 0),
                                    self._geometry(layout), pool_parts=parts,
                                    aux_workers=SIDECAR_WORKERS)
            pool = SidecarPool(name, host_pool, layout, engine, zero_copy=parts is not None,
                               probe_wait_s=self.backend.own.probe_wait_s,
                               parts=len(parts or ()))
        except SidecarRefused:
            raise
        except Exception as exc:
            if engine is not None:
                engine.close()
            raise SidecarRefused(
                f"hicache_mp: SGLang's {name} pool ({layout.page_bytes / MIB:.1f} MiB pages) "
                f"cannot be served: {exc}. Without it no prefix of this model can be "
                f"restored, so the backend is refused.") from exc
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
        # register() refused a staged page over the cap: at least one fits
        pages = pool_pages or max(1, min(SIDECAR_STAGING_PAGES,
                                         b.own.sidecar_staging_bytes // layout.page_bytes))
        cfg = b.config_for(pages)
        names = {}
        if name == MAMBA:   # TP-sharded even when the KV is MLA (replicated)
            names = {"tp_rank": b.shard.tp_rank, "tp_size": b.shard.tp_size}
        # auto (0): up to SIDECAR_WORKERS from the node's budget, as an auxiliary
        # of this rank's KV engine (aux_workers)
        workers = min(SIDECAR_WORKERS, cfg.num_workers) if cfg.num_workers else 0
        if b.own.sidecar_checksum:   # a bad state is a miss, never a hit (module docstring)
            names.update(write_checksum=True, verify_checksum=True, require_checksum=True)
        return dataclasses.replace(
            cfg, num_workers=workers, **names,
            namespace_extra=f"{cfg.namespace_extra}|pool={name}|{layout.describe()}")

    # --- batch_exists_v2 -----------------------------------------------------------
    def _has(self, name: str, keys) -> bytes:
        """One 0/1 byte per key: its page of pool `name` is stored."""
        if name == KV or name in self.kv_names:
            return b"\x01" * len(keys)      # asked of the KV prefix only
        pool = self.pools.get(name)
        if pool is None:
            return bytes(len(keys))
        return pool.present(keys, wait=False).view(np.uint8).tobytes()

    def exists(self, keys, pool_transfers, result_cls):
        """batch_exists_v2: the KV prefix's pages, then each pool's hit policy (hits).

        The sidecar keys the index misses are asked of the store first, with no
        wait: their answers come in while the KV query waits for its own (only
        when KV keys are unknown too: a prefix another process wrote), and the
        sidecars never sleep here. Keys this process wrote are known, so the
        usual query sleeps not at all."""
        keys = keys if isinstance(keys, list) else list(keys)
        for t in pool_transfers or ():
            pool = self.pools.get(pool_name(t.name))
            if pool is not None:
                pool.ask(keys)
        return hits.decide(keys, self.backend.batch_exists(keys), pool_transfers, self._has,
                           result_cls)

    # --- batch_get_v2 / batch_set_v2 ---------------------------------------------
    def io(self, transfers, *, write: bool) -> dict:
        """{pool name: [bool per key]}, exactly len(keys) entries each; a pool
        that is missing, unserved or given mismatched indices answers False.

        Every zero-copy op of the batch (KV and sidecars) is submitted first and
        waited for after: the waits overlap, so the batch sleeps once (on the
        op of the most bytes; the others are done by then, or nearly)."""
        res, started, staged = [], [], []   # res: [name, answer] in transfer order
        try:
            for t in transfers:
                keys = t.keys
                keys = keys if isinstance(keys, list) else list(keys or ())
                res.append([t.name, []])
                if not keys:
                    continue
                name = pool_name(t.name)
                if (name == KV or name in self.kv_names) and write and self.unserved:
                    # a prefix needing an unserved pool is never restored: its KV
                    # pages would be written for nothing
                    res[-1][1] = [False] * len(keys)
                    continue
                if name == KV or name in self.kv_names:
                    b = self.backend
                    if b.zero_copy:     # submitted now, waited for with the sidecars' ops
                        started.append((res[-1], *b.start(keys, b.host_pages(keys, t.host_indices),
                                                          write)))
                    else:               # staged KV: moved (and waited for) by the backend
                        fn = b.batch_set_v1 if write else b.batch_get_v1
                        res[-1][1] = list(fn(keys, t.host_indices))
                    continue
                pool = self.pools.get(name)
                starts = self._starts(pool, name, keys, t.host_indices, write)
                if starts is None:
                    res[-1][1] = [False] * len(keys)
                elif pool.zero_copy:
                    pages = page_index(starts, pool.page_size)
                    started.append((res[-1], *pool.start(keys, pages, write)))
                else:
                    staged.append((res[-1], pool, keys, starts))
        finally:
            # SGLang reuses the slots once this returns: every op submitted is
            # waited for, also when a later submission raised
            timeout = self.backend.io_timeout_s
            for _, eng, op, _ in sorted((s for s in started if s[2] is not None),
                                        key=lambda s: -s[2].num_pages * s[1].geometry.page_bytes):
                wait_or_abandon(eng, op, timeout)
        for entry, _, _, answer in started:
            entry[1] = answer()
        for entry, pool, keys, starts in staged:
            entry[1] = (pool.write if write else pool.read)(keys, starts,
                                                            self.backend.io_timeout_s)
        return dict(res)

    @staticmethod
    def _starts(pool, name, keys, host_indices, write):
        """Each page's first host index (int64), or None (logged) where the
        transfer cannot be served."""
        n = len(keys)
        what = "set" if write else "get"
        idx = None if host_indices is None else as_numpy(host_indices)
        if pool is None or idx is None or idx.size != n * pool.page_size:
            log.error("hicache_mp: %s v2 transfer for pool %r: %s", what, name,
                      "pool not served" if pool is None else
                      f"{n} keys need {n * pool.page_size} host indices, "
                      f"got {0 if idx is None else idx.size}")
            return None
        starts, aligned = page_starts(idx, n, pool.page_size)
        if pool.zero_copy and not aligned:
            # zero-copy moves whole pages: a page that does not start on a page
            # boundary would be read into (or written from) the wrong one
            log.error("hicache_mp: %s v2 transfer for pool %r: a page's host indices "
                      "do not start on a page boundary", what, name)
            return None
        return starts

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
