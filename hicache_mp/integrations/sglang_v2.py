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
import enum
import logging
import threading
import time

import numpy as np
import torch

from shm import PageGeometry, gilkeep

from ..engine import PrefetchEngine
from . import sglang_sidecar
from .sglang_v2_pool import (SidecarPool, _all_ok, _as_numpy, _leading, _missing,  # noqa: F401
                             page_index, page_starts)

log = logging.getLogger("hicache_mp.sglang")

KV = "kv"
MAMBA = "mamba"
SIDECAR_STAGING_BYTES = 64 << 20   # staging memory per sidecar pool (at least one page)
SIDECAR_STAGING_PAGES = 256
SIDECAR_WORKERS = 2


ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS = "all_pages", "trailing_pages", "block_groups"
# id(enum member) -> (member, value): an Enum's `.value` is a Python descriptor
# and its hash a Python method; SGLang hands the same few members every call,
# so each is looked up once and compared as a str from then on.
_VALUES: dict = {}


def pool_name(name) -> str:
    """PoolName enum or str -> its value ('mamba', 'swa', ...)."""
    hit = _VALUES.get(id(name))
    if hit is not None and hit[0] is name:
        return hit[1]
    value = str(getattr(name, "value", name))
    if isinstance(name, enum.Enum):
        _VALUES[id(name)] = (name, value)
    return value


policy_name = pool_name


def trailing_spans(has: bytes, trailing: int) -> list:
    """[(lo, hi)] of the prefixes p (1-based, inclusive) whose last
    min(trailing, p) pages are all present; `has` holds one 0/1 byte per page.
    One step per run of present pages (bytes.find, GIL held), never per page."""
    spans, n, s = [], len(has), has.find(1)
    while s != -1:
        e = has.find(0, s)
        e = n if e == -1 else e          # pages [s, e) are present
        lo = 1 if s == 0 else s + trailing
        if lo <= e:
            spans.append((lo, e))
        s = has.find(1, e) if e < n else -1
    return spans


def intersect(a: list, b: list) -> list:
    """Intersection of two sorted lists of disjoint inclusive spans."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


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
    def _has(self, name: str, keys) -> bytes:
        """One 0/1 byte per key: its page of pool `name` is stored."""
        if name == KV or name in self.kv_names:
            return b"\x01" * len(keys)      # asked of the KV prefix only
        pool = self.pools.get(name)
        if pool is None:
            return bytes(len(keys))
        return pool.present(keys).view(np.uint8).tobytes()

    def exists(self, keys, pool_transfers, result_cls):
        """Prefixes as sorted spans of page counts, intersected pool by pool: the
        work is per run of present pages, never per page or per prefix."""
        keys = keys if isinstance(keys, list) else list(keys)
        kv_pages = self.backend.batch_exists(keys)
        hit_count: dict = {KV: kv_pages} if kv_pages else {}
        spans = [(1, kv_pages)] if kv_pages else []
        prefix = keys[:kv_pages]
        for t in pool_transfers or ():
            if not spans:
                break
            name, policy = pool_name(t.name), policy_name(t.hit_policy)
            if policy == BLOCK_GROUPS:
                boundary = self._block_groups(t, name, keys, kv_pages)
                if boundary:
                    hit_count[t.name] = boundary
                continue  # a verdict of its own; never gates the KV hit
            if policy == ALL_PAGES:
                has = self._has(name, prefix)
                boundary = has.find(0)
                boundary = kv_pages if boundary == -1 else boundary
                pool_spans = [(1, boundary)] if boundary else []
            elif policy == TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                pool_spans = trailing_spans(self._has(name, prefix), trailing)
                boundary = pool_spans[-1][1] if pool_spans else 0
            else:
                raise ValueError(f"hicache_mp: unsupported pool hit policy {t.hit_policy!r}")
            if boundary:
                hit_count[t.name] = boundary
            spans = intersect(spans, pool_spans)
        restorable = []
        for lo, hi in spans:
            restorable += range(lo, hi + 1)
        return result_cls(spans[-1][1] if spans else 0, hit_count, restorable)

    def _block_groups(self, t, name, keys, kv_pages) -> int:
        group, block = int(t.group_pages or 0), int(t.block_pages or 0)
        if group <= 0 or block <= 0:
            raise ValueError(f"hicache_mp: BLOCK_GROUPS transfer {name!r} needs positive "
                             f"group_pages and block_pages, got {group} and {block}")
        gkeys = list(t.keys) if t.keys else keys[:kv_pages]
        full = len(gkeys) // group
        has = self._has(name, gkeys[:full * group])
        first = has.find(0)
        groups = full if first == -1 else first // group
        return min(groups * block, kv_pages)

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
                if name == KV or name in self.kv_names:
                    kv = self._start_kv(keys, t.host_indices, write)
                    if kv is None:      # staged KV: moved (and waited for) by the backend
                        fn = self.backend.batch_set_v1 if write else self.backend.batch_get_v1
                        res[-1][1] = list(fn(keys, t.host_indices))
                    else:
                        started.append((res[-1], *kv))
                    continue
                pool = self.pools.get(name)
                starts = self._starts(pool, name, keys, t.host_indices, write)
                if starts is None:
                    res[-1][1] = [False] * len(keys)
                elif pool.zero_copy:
                    pages = page_index(starts, pool.page_size)
                    started.append((res[-1], *pool.start(keys, pages, write), None))
                else:
                    staged.append((res[-1], pool, keys, starts))
        finally:
            # SGLang reuses the slots once this returns: every op submitted is
            # waited for, also when a later submission raised
            for _, eng, op, _, _ in sorted((s for s in started if s[2] is not None),
                                           key=lambda s: -s[2].num_pages *
                                           s[1].geometry.page_bytes):
                self.backend._wait_on(eng, op)
        for entry, _, _, answer, record in started:
            entry[1] = answer()
            if record is not None:
                record()
        for entry, pool, keys, starts in staged:
            entry[1] = (pool.write if write else pool.read)(keys, starts, self.backend._wait_on)
        return dict(res)

    def _start_kv(self, keys, host_indices, write: bool):
        """The KV transfer of a v2 batch, zero-copy: submitted, not waited for
        (batch_get_v1 / batch_set_v1 without their wait). None: staged."""
        b = self.backend
        if not b.zero_copy:
            return None
        P, n = b.geometry.page_size, len(keys)
        idx = _as_numpy(host_indices)
        if idx.ndim != 1 or len(idx) != n * P:
            raise ValueError(f"hicache_mp: {n} keys need {n * P} host indices "
                             f"(page size {P}), got shape {tuple(idx.shape)}")
        starts, aligned = page_starts(idx, n, P)
        if not aligned:
            raise ValueError("hicache_mp: a page's host indices do not start on a page boundary")
        pages = page_index(starts, P)
        eng, t0 = b.engine, time.perf_counter()
        if not write:
            op = eng.prefetch(keys, pages, policy="wait_complete")
            return (eng, op, lambda: _leading(op.completed_pages, n),
                    lambda: b._record("prefetch", op.completed_pages, t0))
        ok = eng.present(keys)
        if 0 not in ok.tobytes():
            return eng, None, lambda: [True] * n, None
        todo = _missing(ok)
        op = eng.backup(keys if len(todo) == n else [keys[i] for i in todo.tolist()],
                        gilkeep.take(pages, todo))
        lead = [n]

        def answer():
            gilkeep.set_at(ok, todo, _all_ok(op.page_status))
            first = ok.tobytes().find(0)
            lead[0] = n if first == -1 else first
            return _leading(lead[0], n)
        return eng, op, answer, lambda: b._record("backup", len(todo) if lead[0] == n else 0, t0)

    @staticmethod
    def _starts(pool, name, keys, host_indices, write):
        """Each page's first host index (int64), or None (logged) where the
        transfer cannot be served."""
        n = len(keys)
        what = "set" if write else "get"
        idx = None if host_indices is None else _as_numpy(host_indices)
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
