"""HiCacheMP: SGLang's storage calls translated into `PrefetchEngine` calls.

SGLang's `dynamic` factory builds `HiCacheMP(storage_config, kwargs)`, then
calls `register_mem_pool_host(host_pool)`; only then is the page geometry
known, so the engine starts there: zero-copy into SGLang's pool where
`pools.zero_copy_plan` allows, else through `staging`. Hybrid models' other
pools go to `hybrid`. Must not do page I/O (the engine's workers do) or copy
pages itself (`staging` does).

SGLang's calls are synchronous: they submit, then block in `engine.wait`,
which sleeps on a semaphore with the GIL released (no spinning); past
`io_timeout_s` the op is abandoned (common.waits). The v1 calls (batch_get_v1,
batch_set_v1, batch_exists) and the KV part of a v2 batch keep the GIL up to
that sleep: index steps by `indices`, presence as bytes, no numpy reduction
and no per-key Python (shm.gilkeep; tests/test_gil_hold.py). Page files are
hicache_mp's (header + canonical payload), so a store is valid for any host
layout; `hicache-mp import-sglang` converts an SGLang `file` store.

Key namespace: SGLang's `HiCacheFile` suffix rules (`names`): model name; TP
rank/size unless MLA (MLA ranks share pages); PP, CP and DCP suffixes; and
the weights' identity (`server_identity`, decision 91), so two models served
from one path never share pages. Tested
with SGLang 0.5.23 (`.ci/sglang-requirements.txt`).
"""
from __future__ import annotations

import importlib
import logging
import math
import threading
import time

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransferResult
except ImportError as _exc:  # pragma: no cover - exercised only without SGLang
    raise ImportError(
        "hicache_mp.integrations.sglang is an SGLang storage backend and needs SGLang "
        "(tested with sglang==0.5.23; HiCacheStorage from "
        "sglang.srt.mem_cache.hicache_storage could not be imported: "
        f"{_exc}). Install SGLang, or for tests: "
        "pip install --no-deps -r .ci/sglang-requirements.txt") from _exc

import torch

from shm import PageGeometry, gilkeep
from shm.segment import SHM_SIZE_FIX, ShmFullError
from workers import status as st
from workers.naming import KeyRefused
from workers.stores import open_store

from ...engine import PrefetchEngine
from ...engine.config import EngineConfig
from ..common import CallStats, check_known, engine_config, leading, model_identity, \
    own_settings, store_dirs, wait_or_abandon
from .hybrid import HybridPools, SidecarRefused
from .indices import host_pages
from .names import SGLangShard
from .pools import HOW_TO_ZERO_COPY, pool_geometry, zero_copy_plan
from .settings import AdapterConfig, known_keys, storage_dir
from .staging import StagingPath

log = logging.getLogger("hicache_mp.sglang")

# Where SGLang keeps StorageMetrics: 0.5.10 and later, then 0.5.9 and earlier.
STORAGE_METRICS_MODULES = ("sglang.srt.observability.metrics_collector",
                           "sglang.srt.metrics.collector")
COUNTERS = ("staging_copies", "staging_copy_bytes", "get_calls", "set_calls")


def shm_fixes(exc: ShmFullError, config: EngineConfig, *, staged: bool, why: str) -> list:
    """What an SGLang user can change when /dev/shm is too small for the engine:
    zero-copy puts nothing of the pool there (SGLang's shm allocator keeps its
    host pool in a memfd, outside /dev/shm's limit); the staging path's pool is
    `staging_pages`; the rings are the workers'."""
    fixes = [SHM_SIZE_FIX]
    if staged and "pool" in exc.short:
        fixes.append(f'SGLang\'s shm allocator, zero-copy ("allocator": "shm" in '
                     f'--hicache-storage-backend-extra-config; this engine stages because '
                     f'{why}), so that no pool of the engine\'s is in /dev/shm')
        fixes.append(f'a lower "staging_pages" in --hicache-storage-backend-extra-config '
                     f'({config.host_pool_pages} now)')
    if "rings" in exc.short and "pool" not in exc.short:
        fixes.append(f'fewer workers: "num_workers" in --hicache-storage-backend-extra-config '
                     f'({"auto" if not config.num_workers else config.num_workers} now)')
    return fixes


def storage_metrics(calls: dict):
    """SGLang's StorageMetrics holding `calls` (CallStats.take_calls), from the
    first of SGLang's modules that has the class; None where none imports."""
    for name in STORAGE_METRICS_MODULES:
        try:
            cls = importlib.import_module(name).StorageMetrics
        except Exception:  # absent, or its own imports fail (e.g. no transformers)
            continue
        m = cls()
        for k, v in calls.items():
            getattr(m, k).extend(v)
        return m
    return None


def server_identity(storage_config, extra: dict) -> str:
    """The weights' identity for the key namespace (common.identity): the
    extra config's `namespace` if set, else from SGLang's server args (model
    path, revision, served model name, weight version) where this process has
    them, else from the storage config's model name (SGLang passes the model
    path)."""
    if extra.get("namespace"):
        return model_identity(None, namespace=extra["namespace"])
    args = None
    try:
        from sglang.srt.runtime_context import get_server_args
        args = get_server_args()
    except Exception:   # outside a server, or another SGLang version
        args = None
    path = getattr(args, "model_path", None) or getattr(storage_config, "model_name", None)
    served = getattr(args, "served_model_name", None)
    return model_identity(path, revision=getattr(args, "revision", None),
                          served_name=None if served == path else served,
                          weight_version=getattr(args, "weight_version", None))


def node_ranks(shard: SGLangShard) -> int:
    """This server's ranks on this node, one engine each: they share the node's
    auto worker budget (decision 42). TP x PP ranks, at most one per local GPU."""
    ranks = shard.tp_size * shard.pp_size
    try:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        gpus = 0
    return min(ranks, gpus) if gpus else ranks


def unwritten(eng: PrefetchEngine, keys, pages):
    """(ok: per key, stored already; the positions still to write, their keys
    and pages). Positions None: every page is stored. What the index knows is
    stored is not written again."""
    ok = eng.present(keys)
    if 0 not in ok.tobytes():
        return ok, None, None, None
    todo = gilkeep.where(ok, False)
    if len(todo) == len(keys):
        return ok, todo, keys, pages
    return ok, todo, [keys[i] for i in todo.tolist()], gilkeep.take(pages, todo)


class HiCacheMP(HiCacheStorage):
    """hicache_mp as an SGLang HiCache storage backend (see the module docstring).

    Extra-config keys (all optional): `storage_dir` (else `file_storage_path`,
    else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache_mp),
    `staging_pages`, `io_timeout_s`, `zero_copy` (false forces the staging
    path), `probe_wait_s` (settings.AdapterConfig), and every EngineConfig
    setting declared with `sglang=True` (hicache_mp.engine.config: `num_workers`,
    `direct_io`, `fsync`, `write_checksum`, `storage_max_bytes` ("500G" or
    bytes), ...), parsed strictly by EngineConfig. A key nobody reads is
    logged once: a typo must not silently leave the disk without its limit.
    """

    def __init__(self, storage_config, kwargs=None):
        self.storage_config = storage_config
        self.extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.shard = SGLangShard.from_storage_config(storage_config,
                                                     server_identity(storage_config, self.extra))
        self.is_mla = self.shard.is_mla
        self.storage_dir = store_dirs(storage_dir(self.extra), log=log)
        self.own = own_settings(AdapterConfig, self.extra)
        self.io_timeout_s = None if math.isinf(self.own.io_timeout_s) else self.own.io_timeout_s
        unknown = check_known(self.extra, self.known_keys())
        if unknown:
            log.warning("hicache_mp: extra-config key(s) %s are not used by hicache_mp or by "
                        "SGLang's dynamic backend loader (known: %s)", unknown,
                        ", ".join(sorted(self.known_keys())))
        self.mem_pool_host = None
        self.engine: PrefetchEngine | None = None
        self._closed = False          # close() ran: calls say so, not "not registered"
        # hit_query_at_once's answer, kept for the query that follows on its
        # thread: (thread, keys, {key: position}, leading count)
        self._at_once: tuple | None = None
        self.zero_copy = False
        self.fallback_reason = ""
        self.geometry: PageGeometry | None = None
        self._staging: StagingPath | None = None       # the staging path (main or legacy)
        self._lock = threading.Lock()
        self.stats = CallStats(COUNTERS, per_call=bool(getattr(
            storage_config, "enable_storage_metrics", False)))
        self._warned: set[str] = set()
        self.hybrid = HybridPools(self)

    # --- attach -------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.close()  # a re-attach replaces the engine
        self._closed = False
        g, why = zero_copy_plan(mem_pool_host, self.is_mla)
        chosen = g is not None and not self.own.zero_copy  # the user's setting, not a limit
        if chosen:
            g, why = None, '"zero_copy": false in the extra-config'
        if g is not None:
            self.engine = self._start(self.config_for(int(mem_pool_host.page_num)), g,
                                      pool_fd=mem_pool_host.fd)
            self.zero_copy, self.geometry, self.fallback_reason = True, g, ""
            log.info("hicache_mp: zero-copy into SGLang's %s host pool (%d pages of %d bytes, "
                     "%d workers, store %s)", g.layout, mem_pool_host.page_num, g.page_bytes,
                     self.engine.worker_count(), self.storage_dir)
            return
        self.fallback_reason = why
        self.geometry = pool_geometry(mem_pool_host, self.is_mla)
        self._staging = self._new_staging(self._start(self.config_for(self.own.staging_pages),
                                                      self.geometry, why=why))
        self.engine = self._staging.engine
        log.warning("hicache_mp: not zero-copy: %s; pages are staged through an engine-owned "
                    "shared-memory pool and copied (one extra copy per page)%s", why,
                    "." if chosen else f". {HOW_TO_ZERO_COPY}.")

    # --- v2: hybrid models' sidecar pools (hybrid.HybridPools) ------------------
    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Every pool of a hybrid model, KV included, also later at runtime. A pool
        that cannot be served is refused (hybrid.SidecarRefused): every engine is
        closed first, so nothing is left running and no KV page is written for
        prefixes that could never be restored."""
        try:
            self.hybrid.register(host_pool, host_pool_name)
        except SidecarRefused:
            self.close()
            raise

    def on_host_pools_registered(self) -> None:
        if self.hybrid.unserved:
            log.warning("hicache_mp: sidecar pools not served: %s", self.hybrid.unserved)

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        self._need_engine()
        return self.hybrid.exists(keys, pool_transfers, PoolTransferResult)

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        self._need_engine()
        return self.hybrid.io(transfers, write=False)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        self._need_engine()
        return self.hybrid.io(transfers, write=True)

    @classmethod
    def known_keys(cls) -> frozenset:
        """Every extra-config key anyone reads."""
        return known_keys()

    def config_for(self, pages: int) -> EngineConfig:
        """This backend's engine settings for a host pool of `pages` (its KV
        engine's, its staging engine's and, through it, the hybrid sidecars')."""
        return engine_config(self.extra, storage_dir=self.storage_dir, host_pool_pages=pages,
                             defaults={"node_engines": node_ranks(self.shard)},
                             **self.shard.engine_names())

    def _start(self, config: EngineConfig, geometry: PageGeometry, *, pool_fd=None,
               why: str = "") -> PrefetchEngine:
        """The KV engine; a /dev/shm too small is an error naming SGLang's
        settings (the engine's own, host_pool_pages, is not one of them). The
        engine released what it made before the error came here."""
        try:
            return PrefetchEngine(config, geometry, pool_fd=pool_fd)
        except ShmFullError as exc:
            raise exc.with_fixes(shm_fixes(exc, config, staged=pool_fd is None,
                                           why=why)) from None

    def _need_engine(self) -> PrefetchEngine:
        if self.engine is None and self._closed:
            raise RuntimeError("hicache_mp: this storage backend is closed (close() was called: "
                               "SGLang detached it or is shutting down); attach a new backend "
                               "to use storage again")
        if self.engine is None:
            raise RuntimeError("hicache_mp: register_mem_pool_host() has not been called "
                               "(SGLang calls it right after constructing the backend)")
        return self.engine

    def _new_staging(self, engine: PrefetchEngine, main=None) -> StagingPath:
        return StagingPath(engine, self.mem_pool_host, self.is_mla, self.stats,
                           self.io_timeout_s, main)

    # --- v1 (zero-copy interface, "interface_v1": 1) ------------------------
    def batch_exists(self, keys, extra_info=None) -> int:
        """How many leading keys have a page in the store."""
        # Keys the index does not know (an MLA writer rank's pages, another
        # node's) are asked of the store by the workers; SGLang calls this from
        # its prefetch thread, which may wait for the answers (GIL released).
        keys = list(keys)
        n = self._answered_at_once(keys)
        if n is not None:
            return n
        eng = self._need_engine()
        try:
            return eng.exists(keys, wait_s=self.own.probe_wait_s)
        except KeyRefused as exc:
            return self._refused(exc, "batch_exists", 0)

    def _answered_at_once(self, keys) -> int | None:
        """The count hit_query_at_once found for `keys` (the whole list it was
        asked about, or a run of it, as SGLang queries in 128-key batches) when
        this is the thread that asked; None otherwise. Answered from that one
        pass: no digest twice per page on the scheduler thread, and no wait even
        if the store's answer it relied on has gone stale since."""
        at_once = self._at_once
        if at_once is None or not keys or at_once[0] != threading.get_ident():
            return None
        _, asked, where, n = at_once
        at = where.get(keys[0])
        if at is None or asked[at:at + len(keys)] != keys:
            self._at_once = None
            return None
        if at + len(keys) >= len(asked):
            self._at_once = None     # the query's last batch: nothing more to answer
        return min(len(keys), max(0, n - at))

    def hit_query_at_once(self, keys, pool_transfers=None) -> bool:
        """Whether batch_exists / batch_exists_v2 on `keys` answers without
        waiting (the SGLang fast path's question before it runs the hit query
        on the scheduler thread): every key indexed, or the store's answer for
        the first missing one already in (engine.exists_at_once). The v2
        query's sidecar pools never wait (hybrid.exists), so the KV keys decide."""
        if self.engine is None or not keys:
            return False
        keys = list(keys)
        try:
            n = self.engine.exists_at_once(keys)
        except KeyRefused:
            return False  # batch_exists, on the prefetch thread, answers (and logs) it
        if n is None:
            return False
        # The query that follows on this thread is answered from this pass
        # (_answered_at_once): a negative-cache entry that expires in between
        # would otherwise make it wait probe_wait_s on the scheduler thread.
        self._at_once = (threading.get_ident(), keys, {k: i for i, k in enumerate(keys)}, n)
        return True

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._v1(keys, host_indices, write=False)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        return self._v1(keys, host_indices, write=True)

    def _v1(self, keys, host_indices, write: bool) -> list[bool]:
        keys = list(keys)
        if not keys:
            return []
        try:
            return self._v1_keys(keys, host_indices, write)
        except KeyRefused as exc:   # checked before any page moves
            return self._refused(exc, "batch_set_v1" if write else "batch_get_v1",
                                 [False] * len(keys))

    def _v1_keys(self, keys, host_indices, write: bool) -> list[bool]:
        pages = self.host_pages(keys, host_indices)
        if self.zero_copy:
            return self.finish(*self.start(keys, pages, write))
        if not write:
            t0 = time.perf_counter()
            return self._got(self._staging.read_pages(keys, pages), len(keys), t0)
        ok, todo, tkeys, tpages = unwritten(self.engine, keys, pages)
        t0 = time.perf_counter()
        done = None if todo is None else self._staging.write_pages(tkeys, tpages)
        return self._wrote(ok, todo, done, t0)

    def host_pages(self, keys, host_indices):
        """The KV host pool's page number of each key's page (indices.host_pages)."""
        self._need_engine()
        return host_pages(len(keys), host_indices, self.geometry.page_size)

    def start(self, keys, pages, write: bool):
        """A zero-copy KV batch submitted, not waited for: (engine, op or None,
        answer); answer(), once the op is done, records the call and gives
        SGLang's per-key answer. batch_get_v1 / batch_set_v1 wait for it at
        once; a v2 batch (hybrid.HybridPools.io) after submitting its other pools."""
        eng, t0, n = self.engine, time.perf_counter(), len(keys)
        if not write:
            op = eng.prefetch(keys, pages, policy="wait_complete")
            return eng, op, lambda: self._got(op.completed_pages, n, t0)
        ok, todo, tkeys, tpages = unwritten(self.engine, keys, pages)
        if todo is None:
            return eng, None, lambda: self._wrote(ok, None, None, t0)
        op = eng.backup(tkeys, tpages)
        return eng, op, lambda: self._wrote(ok, todo, gilkeep.eq(op.page_status, st.OK), t0)

    def finish(self, eng, op, answer) -> list[bool]:
        """Wait for a started batch (abandoning it past io_timeout_s), then answer."""
        if op is not None:
            wait_or_abandon(eng, op, self.io_timeout_s)
        return answer()

    def _got(self, landed: int, n: int, t0: float) -> list[bool]:
        self._record("prefetch", landed, t0)
        return leading(landed, n)

    def _wrote(self, ok, todo, done, t0: float) -> list[bool]:
        """SGLang's answer to a write: the leading run of stored pages. Bandwidth
        counts the pages written, and only when the whole batch is stored."""
        if todo is not None:
            gilkeep.set_at(ok, todo, done)
        lead = gilkeep.first_false(ok)
        self._record("backup", (0 if todo is None else len(todo)) if lead == len(ok) else 0, t0)
        return leading(lead, len(ok))

    # --- the staging engine for legacy calls ------------------------------------
    def _staging_path(self) -> StagingPath:
        if self._staging is None:  # zero-copy mode, and a legacy call came in
            with self._lock:
                if self._staging is None:
                    self._warn_once("legacy", "hicache_mp: SGLang called the legacy (non-v1) API; "
                                    "set \"interface_v1\": 1 in the extra-config so pages move "
                                    "zero-copy. Staging these through a second engine.")
                    cfg = self.config_for(self.own.staging_pages)
                    cfg.num_workers = 1
                    self._staging = self._new_staging(
                        PrefetchEngine(cfg, self.geometry.with_layout("page_first")),
                        main=self.engine)
        return self._staging

    # --- legacy API (SGLang without interface_v1) ---------------------------
    def get(self, key, target_location=None, target_sizes=None):
        out = self.batch_get([key], None if target_location is None else [target_location])
        return out[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Pages as flat tensors in the host layout's page order (SGLang's
        get_dummy_flat_data_page / set_from_flat_data_page convention); None = miss."""
        keys = list(keys)
        if not keys:
            return []
        self._need_engine()
        stg = self._staging_path()
        t0 = time.perf_counter()
        try:
            out = stg.read_flat(keys, target_locations)
        except KeyRefused as exc:
            return self._refused(exc, "batch_get", [None] * len(keys))
        self._record("prefetch", sum(t is not None for t in out), t0)
        return out

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        keys = list(keys)
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ValueError("hicache_mp: batch_set needs one flat page tensor per key")
        self._need_engine()
        stg = self._staging_path()
        t0 = time.perf_counter()
        try:
            ok_all = stg.write_flat(keys, values)
        except KeyRefused as exc:
            return self._refused(exc, "batch_set", False)
        self._record("backup", len(keys) if ok_all else 0, t0)
        return ok_all

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    # --- housekeeping -----------------------------------------------------------
    def clear(self) -> bool:
        """Remove every page file of the store directory (as SGLang's `file` backend
        clears its directory), whichever model, rank or server wrote it: a page
        file's name and header carry a digest of (namespace, key) and the
        geometry, never the namespace, so this backend's pages cannot be told
        from others' (decision 97). Logged as a warning. Other files are left alone."""
        root = self.storage_dir
        log.warning("hicache_mp: clear() removes every page file of the whole store %s, shared "
                    "by every server, rank and model that uses it, not only this model's "
                    "(page files carry no namespace; decision 97)", root)
        removed = 0
        for part in open_store(root).parts():
            for page in part.scan().pages:
                removed += part.remove(page.digest)
        for eng in self._engines():
            eng.forget_all()
        log.info("hicache_mp: cleared %d pages from %s", removed, root)
        return True

    def metrics(self) -> dict:
        """The engine's metrics, plus the adapter's: zero_copy, staging copies."""
        out = dict(self.engine.metrics()) if self.engine is not None else {}
        out.update(self.stats.counters())
        out["zero_copy"] = self.zero_copy
        out["fallback_reason"] = self.fallback_reason
        out["layout"] = getattr(self.mem_pool_host, "layout", None)
        out.update(self.hybrid.metrics())
        return out

    def get_stats(self):
        """SGLang's StorageMetrics (pages and GB/s per call since the last poll),
        from whichever of SGLang's modules has it, or None where none imports.
        Per-call figures are kept only with SGLang's enable_storage_metrics on:
        SGLang calls this only then, and would otherwise never empty them."""
        return storage_metrics(self.stats.take_calls())

    def _record(self, kind: str, pages: int, t0: float) -> None:
        self.stats.record(kind, pages, time.perf_counter() - t0,
                          self.geometry.page_bytes if self.geometry else 0,
                          counter="get_calls" if kind == "prefetch" else "set_calls")

    def _refused(self, exc: KeyRefused, call: str, answer):
        """SGLang's answer for a call naming a key no page file can have: a miss
        or a page not stored (the scheduler must never see the exception; real
        keys are short hex digests), logged once."""
        self._warn_once("key", f"hicache_mp: {call} named a key the store refuses ({exc}); "
                               f"answered as a miss / not stored (later ones are not logged)")
        return answer

    def _warn_once(self, cause: str, msg: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            log.warning(msg)

    def _engines(self) -> list[PrefetchEngine]:
        engines = [self.engine] if self.engine is not None else []
        if self._staging is not None and self._staging.engine is not self.engine:
            engines.append(self._staging.engine)
        hybrid = getattr(self, "hybrid", None)
        return engines + (hybrid.engines() if hybrid is not None else [])

    def close(self) -> None:
        """Flush backups in flight, stop the workers and release every segment
        (SGLang calls this on detach and at server shutdown)."""
        hybrid = getattr(self, "hybrid", None)
        if hybrid is not None:
            hybrid.close()
        for eng in self._engines():
            eng.close(flush=True)
        self.engine, self._staging, self.zero_copy = None, None, False
        self._closed = True

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
