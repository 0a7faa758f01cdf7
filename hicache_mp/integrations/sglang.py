"""SGLang HiCache L3 storage backend: hicache_mp behind SGLang's `dynamic` backend.

    --enable-hierarchical-cache --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name":"hicache_mp",
        "module_path":"hicache_mp.integrations.sglang","class_name":"HiCacheMP",
        "interface_v1":1,"allocator":"shm","num_workers":8}'

Owns the translation between SGLang's storage calls and `PrefetchEngine`:
SGLang's factory builds `HiCacheMP(storage_config, kwargs)`, then calls
`register_mem_pool_host(host_pool)`; only then is the page geometry known, so
the engine starts there. Must not do page I/O: the engine's workers do.

Two data paths, chosen once per host pool:

    zero-copy  ("allocator":"shm", layout layer_first or page_first_direct)
        SGLang's host pool is a memfd. The engine dups its fd and hands it to
        every worker (Popen pass_fds), which maps it and preadv/pwritev's page
        files straight into/out of SGLang's pool slots. Page byte runs are
        SGLang's own get_page_buffer_meta() pointers minus the pool base,
        checked against the geometry at registration.

    staging    (anything else: the default allocator has no fd; SGLang's
        page_first / page_head layouts are token- or head-major, not a few
        runs in the canonical [kv][layer][token][head][dim] file order)
        Workers read into an engine-owned shm pool; a torch copy_ (GIL-free,
        one per page) moves pages to/from SGLang's pool. One warning says how
        to get zero-copy. `metrics()["staging_copies"]` counts these copies.

SGLang calls are synchronous: they submit, then block in `engine.wait`,
which sleeps on a semaphore with the GIL released (no spinning). Page files
are hicache_mp's (header + canonical payload), so a store is valid for any
host layout; `hicache-mp import-sglang` converts an SGLang `file` store.

Key namespace: SGLang's `HiCacheFile` suffix rules (see `sglang_names`):
model name; TP rank/size unless MLA (MLA ranks share pages); PP, CP and DCP
suffixes. Tested with SGLang 0.5.23 (`.ci/sglang-requirements.txt`).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
import threading
import time

import numpy as np

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
from workers import naming
from workers import status as st
from workers.stores import open_store
from workers.timing import ABANDON_GRACE_S

from .. import config
from ..config import EngineConfig, parse_value, setting, settings, sglang_keys, sglang_options
from ..engine import PrefetchEngine
from ..ops import Op
from .sglang_layouts import flat_page_view, host_page_view
from .sglang_names import SGLangShard
from .sglang_v2 import HybridPools

log = logging.getLogger("hicache_mp.sglang")

ZERO_COPY_LAYOUTS = ("layer_first", "page_first_direct")
DEFAULT_STORAGE_DIR = "/tmp/hicache_mp"
DEFAULT_STAGING_PAGES = 256  # two of SGLang's STORAGE_BATCH_SIZE (128) batches in flight
# Extra-config keys SGLang itself reads (its dynamic loader and allocator switches).
SGLANG_OWN_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "allocator",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size", "file_storage_path"})


@dataclass
class AdapterConfig:
    """This adapter's own extra-config keys, declared as the engine's are (hicache_mp.config)."""
    staging_pages: int = setting(DEFAULT_STAGING_PAGES, "staging pool size on the non-zero-copy "
                                 "path", sglang=True, lo=1)
    io_timeout_s: float = setting(math.inf, "give up on a batch after this long: its "
                                  "unfinished pages are reported False", sglang=True, lo=0,
                                  lo_open=True, finite=False)
    zero_copy: bool = setting(True, "false forces the staging path", sglang=True)
    probe_wait_s: float = setting(0.1, "batch_exists waits up to this long for the workers' "
                                  "answers about keys the index does not know (pages other "
                                  "engines or nodes wrote); 0: answer from the index, later "
                                  "calls see what the workers found", sglang=True, lo=0)

    def __post_init__(self):
        for f in settings(type(self)):
            setattr(self, f.name, parse_value(f, getattr(self, f.name)))


HOW_TO_ZERO_COPY = ('For zero-copy start SGLang with "allocator":"shm" in '
                    '--hicache-storage-backend-extra-config (SGLang >= 0.5.17) and '
                    '--hicache-mem-layout layer_first or page_first_direct')


# Where SGLang keeps StorageMetrics: 0.5.10 and later, then 0.5.9 and earlier.
STORAGE_METRICS_MODULES = ("sglang.srt.observability.metrics_collector",
                           "sglang.srt.metrics.collector")


def _storage_metrics_class():
    import importlib
    for name in STORAGE_METRICS_MODULES:
        try:
            return importlib.import_module(name).StorageMetrics
        except Exception:  # absent, or its own imports fail (e.g. no transformers)
            continue
    return None


# --- host pool geometry and views (torch side) --------------------------------
def pool_geometry(host_pool, is_mla: bool, layout: str = "page_first") -> PageGeometry:
    """The hicache_mp geometry of an SGLang host pool's pages (MHA or MLA)."""
    dtype = str(host_pool.dtype).removeprefix("torch.")
    # The pool's class decides the page shape (MLA pools have kv_cache_dim and no
    # head_num); the storage config's is_mla_model decides only the namespace.
    if is_mla and not hasattr(host_pool, "head_num"):
        dim = getattr(host_pool, "kv_cache_dim", None)
        if dim is None:
            dim = host_pool.kv_lora_rank + host_pool.qk_rope_head_dim
        return PageGeometry(num_layers=int(host_pool.layer_num), num_kv_heads=1, head_dim=int(dim),
                            page_size=int(host_pool.page_size), dtype=dtype, layout=layout, mla=True)
    return PageGeometry(num_layers=int(host_pool.layer_num), num_kv_heads=int(host_pool.head_num),
                        head_dim=int(host_pool.head_dim), page_size=int(host_pool.page_size),
                        dtype=dtype, layout=layout)


def _buffer_address(buf) -> int | None:
    try:
        arr = np.frombuffer(buf, dtype=np.uint8, count=1)
        return int(arr.ctypes.data)
    except Exception:
        return None


def zero_copy_plan(host_pool, is_mla: bool) -> tuple[PageGeometry | None, str]:
    """(geometry whose page runs are SGLang's, "") or (None, why not).

    The runs come from SGLang's own get_page_buffer_meta(): pointer minus the
    pool base, reordered from SGLang's order (MHA: per layer K, V) into the
    canonical one (all K layers, then all V layers), and must equal the
    geometry's runs for the first, second and last page.
    """
    fd = getattr(host_pool, "fd", None)
    if fd is None:
        return None, "the host pool has no file descriptor (SGLang's default allocator)"
    layout = getattr(host_pool, "layout", None)
    if layout not in ZERO_COPY_LAYOUTS:
        return None, (f"host layout {layout!r} is not a few runs in canonical page order "
                      f"(zero-copy layouts: {', '.join(ZERO_COPY_LAYOUTS)})")
    try:
        g = pool_geometry(host_pool, is_mla, layout)
        num_pages = int(host_pool.page_num)
        base = int(host_pool.kv_buffer.data_ptr())
        mms = getattr(getattr(host_pool, "allocator", None), "mms", None) or []
        if mms:  # the fd's mapping must start where the pool starts
            start = _buffer_address(mms[0])
            if start is not None and start != base:
                return None, f"the host pool starts {base - start} bytes into its memfd"
        size = os.fstat(fd).st_size
        if size < g.pool_bytes(num_pages):
            return None, f"the memfd holds {size} bytes, the pool needs {g.pool_bytes(num_pages)}"
        P = g.page_size
        for page in sorted({0, min(1, num_pages - 1), num_pages - 1}):
            ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(page * P, (page + 1) * P))
            runs = [(int(p) - base, int(s)) for p, s in zip(ptrs, sizes)]
            if g.kv_count == 2:
                runs = runs[0::2] + runs[1::2]
            if runs != g.page_runs(page, num_pages):
                return None, (f"SGLang's page-buffer metadata for page {page} does not match "
                              f"the {layout} geometry")
    except Exception as exc:  # an unfamiliar pool: never guess offsets
        return None, f"cannot read the host pool's page-buffer metadata ({exc!r})"
    return g, ""


class _Staging:
    """An engine with its own shm pool, plus a free list of its slots."""

    def __init__(self, engine: PrefetchEngine):
        self.engine = engine
        self.free = list(range(engine.config.host_pool_pages))
        self.cond = threading.Condition()

    def take(self, n: int) -> list[int]:
        n = min(n, self.engine.config.host_pool_pages)
        with self.cond:
            while not self.free:
                self.cond.wait()
            slots, self.free = self.free[:n], self.free[n:]
            return slots

    def give(self, slots) -> None:
        with self.cond:
            self.free.extend(slots)
            self.cond.notify_all()


def host_indices_numpy(host_indices) -> np.ndarray:
    """SGLang's host indices as numpy. A CPU tensor is viewed, not copied with
    `.cpu()`: every torch op releases the GIL, and under a busy scheduler each
    release costs the storage thread up to a switch interval to get it back."""
    if isinstance(host_indices, torch.Tensor):
        return (host_indices if host_indices.is_cpu else host_indices.cpu()).numpy()
    return np.asarray(host_indices)


def _leading(n: int, total: int) -> list[bool]:
    """SGLang's per-key answer for a leading run of `n` of `total` (no per-key Python)."""
    return [True] * n + [False] * (total - n)


class HiCacheMP(HiCacheStorage):
    """hicache_mp as an SGLang HiCache storage backend (see the module docstring).

    Extra-config keys (all optional): `storage_dir` (else `file_storage_path`,
    else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache_mp),
    `staging_pages`, `io_timeout_s`, `zero_copy` (false forces the staging
    path), and every EngineConfig setting declared with `sglang=True`
    (hicache_mp.config: `num_workers`, `direct_io`, `fsync`, `write_checksum`,
    `storage_max_bytes` ("500G" or bytes), ...), parsed strictly by
    EngineConfig. A key nobody reads is logged once: a typo must not silently
    leave the disk without its limit.
    """

    def __init__(self, storage_config, kwargs=None):
        self.storage_config = storage_config
        self.extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.shard = SGLangShard.from_storage_config(storage_config)
        self.is_mla = self.shard.is_mla
        self.storage_dir = (self.extra.get("storage_dir") or self.extra.get("file_storage_path")
                            or os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
                            or DEFAULT_STORAGE_DIR)
        self.own = AdapterConfig(**{k: v for k, v in self.extra.items()
                                    if k in sglang_keys(AdapterConfig) and v is not None})
        self.io_timeout_s = None if math.isinf(self.own.io_timeout_s) else self.own.io_timeout_s
        known = self.known_keys()
        unknown = sorted(set(self.extra) - known)
        if unknown:
            log.warning("hicache_mp: extra-config key(s) %s are not used by hicache_mp or by "
                        "SGLang's dynamic backend loader (known: %s)", unknown,
                        ", ".join(sorted(known)))
        self.mem_pool_host = None
        self.engine: PrefetchEngine | None = None
        self.zero_copy = False
        self.fallback_reason = ""
        self.geometry: PageGeometry | None = None
        self._staging: _Staging | None = None          # the staging path (main or legacy)
        self._lock = threading.Lock()
        self._counts = {"staging_copies": 0, "staging_copy_bytes": 0, "get_calls": 0,
                        "set_calls": 0}
        self._stats = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                       "backup_bandwidth": []}
        self.metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._warned: set[str] = set()
        self.hybrid = HybridPools(self)

    # --- attach -------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.close()  # a re-attach replaces the engine
        g, why = zero_copy_plan(mem_pool_host, self.is_mla)
        if g is not None and not self.own.zero_copy:
            g, why = None, '"zero_copy": false in the extra-config'
        if g is not None:
            self.engine = PrefetchEngine(self._config(int(mem_pool_host.page_num)), g,
                                         pool_fd=mem_pool_host.fd)
            self.zero_copy, self.geometry, self.fallback_reason = True, g, ""
            log.info("hicache_mp: zero-copy into SGLang's %s host pool (%d pages of %d bytes, "
                     "%d workers, store %s)", g.layout, mem_pool_host.page_num, g.page_bytes,
                     self.engine.worker_count(), self.storage_dir)
            return
        self.fallback_reason = why
        self.geometry = pool_geometry(mem_pool_host, self.is_mla)
        pages = self.own.staging_pages
        self._staging = _Staging(PrefetchEngine(self._config(pages), self.geometry))
        self.engine = self._staging.engine
        log.warning("hicache_mp: not zero-copy: %s; pages are staged through an engine-owned "
                    "shared-memory pool and copied (one extra copy per page). %s.",
                    why, HOW_TO_ZERO_COPY)

    # --- v2: hybrid models' sidecar pools (hicache_mp.integrations.sglang_v2) ---
    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Every pool of a hybrid model, KV included, also later at runtime."""
        self.hybrid.register(host_pool, host_pool_name)

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
        return SGLANG_OWN_KEYS | sglang_keys(AdapterConfig) | sglang_keys()

    def _config(self, pages: int) -> EngineConfig:
        options = sglang_options(self.extra)
        options["storage_dir"] = self.storage_dir
        options.setdefault("node_engines", self._node_ranks())
        return config.EngineConfig(host_pool_pages=pages, **options, **self.shard.engine_names())

    def _node_ranks(self) -> int:
        """This server's ranks on this node, one engine each: they share the node's
        auto worker budget (decision 42). TP x PP ranks, at most one per local GPU."""
        ranks = self.shard.tp_size * self.shard.pp_size
        try:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:
            gpus = 0
        return min(ranks, gpus) if gpus else ranks

    def _need_engine(self) -> PrefetchEngine:
        if self.engine is None:
            raise RuntimeError("hicache_mp: register_mem_pool_host() has not been called "
                               "(SGLang calls it right after constructing the backend)")
        return self.engine

    # --- v1 (zero-copy interface, "interface_v1": 1) ------------------------
    def batch_exists(self, keys, extra_info=None) -> int:
        """How many leading keys have a page in the store."""
        # Keys the index does not know (an MLA writer rank's pages, another
        # node's) are asked of the store by the workers; SGLang calls this from
        # its prefetch thread, which may wait for the answers (GIL released).
        return self._need_engine().exists(list(keys), wait_s=self.own.probe_wait_s)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        keys = list(keys)
        if not keys:
            return []
        pages = self._host_pages(keys, host_indices)
        t0 = time.perf_counter()
        if self.zero_copy:
            op = self.engine.prefetch(keys, pages, policy="wait_complete")
            self._wait_on(self.engine, op)
            ok = op.completed_pages
        else:
            ok = self._staged_get(keys, pages)
        self._record("prefetch", ok, t0)
        return _leading(ok, len(keys))

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        keys = list(keys)
        if not keys:
            return []
        pages = self._host_pages(keys, host_indices)
        eng = self.engine
        ok = eng.present(keys)
        t0 = time.perf_counter()
        todo = None if gilkeep.all_(ok) else np.flatnonzero(~ok)
        if todo is not None:
            if len(todo) == len(keys):
                tkeys, tpages = keys, pages
            else:
                tkeys, tpages = [keys[i] for i in todo.tolist()], pages[todo]
            if self.zero_copy:
                op = eng.backup(tkeys, tpages)
                self._wait_on(eng, op)
                done = op.page_status == st.OK
            else:
                done = self._staged_set(tkeys, tpages)
            ok[todo] = done
        lead = gilkeep.first_false(ok)
        self._record("backup", (0 if todo is None else len(todo)) if lead == len(keys) else 0, t0)
        return _leading(lead, len(keys))

    def _host_pages(self, keys, host_indices) -> np.ndarray:
        self._need_engine()
        P = self.geometry.page_size
        idx = host_indices_numpy(host_indices)
        if idx.ndim != 1 or len(idx) != len(keys) * P:
            raise ValueError(f"hicache_mp: {len(keys)} keys need {len(keys) * P} host indices "
                             f"(page size {P}), got shape {tuple(idx.shape)}")
        starts = idx[::P].astype(np.int64)
        if gilkeep.any_(starts % P != 0):
            raise ValueError("hicache_mp: a page's host indices do not start on a page boundary")
        return starts // P

    # --- the staging path -----------------------------------------------------
    def _staging_path(self) -> _Staging:
        if self._staging is None:  # zero-copy mode, and a legacy call came in
            with self._lock:
                if self._staging is None:
                    self._warn_once("legacy", "hicache_mp: SGLang called the legacy (non-v1) API; "
                                    "set \"interface_v1\": 1 in the extra-config so pages move "
                                    "zero-copy. Staging these through a second engine.")
                    cfg = self._config(self.own.staging_pages)
                    cfg.num_workers = 1
                    self._staging = _Staging(PrefetchEngine(cfg, self.geometry.with_layout("page_first")))
        return self._staging

    def _copy(self, dst, src) -> None:
        dst.copy_(src)  # torch releases the GIL for the copy
        with self._lock:
            self._counts["staging_copies"] += 1
            self._counts["staging_copy_bytes"] += self.geometry.page_bytes

    def _through_staging(self, keys, *, write: bool, fill=None, take_out=None,
                         stop_short: bool = False) -> np.ndarray:
        """Move `keys` through the staging engine in chunks of free slots.

        `fill(start, slots)` puts pages into the slots before a write;
        `take_out(start, slots, op)` copies pages out after a read. Returns one
        bool per key (page ok). With `stop_short`, stops after the first chunk
        whose pages did not all land, since only the leading run counts.
        """
        stg = self._staging_path()
        ok = np.zeros(len(keys), dtype=bool)
        done = 0
        while done < len(keys):
            slots = stg.take(len(keys) - done)
            n = len(slots)
            chunk = keys[done:done + n]
            try:
                if fill is not None:
                    fill(done, slots)
                op = (stg.engine.backup(chunk, slots) if write else
                      stg.engine.prefetch(chunk, slots, policy="wait_complete"))
                self._wait_on(stg.engine, op)
                ok[done:done + n] = op.page_status == st.OK
                if take_out is not None:
                    take_out(done, slots, op)
            finally:
                stg.give(slots)
            if write:
                self._index_written(chunk, ok[done:done + n], stg.engine)
            done += n
            if stop_short and op.completed_pages < n:
                break
        return ok

    def _staged_get(self, keys, pages) -> int:
        """Read into staging slots, copy the leading landed pages to SGLang's pool."""
        pool = self._staging_path().engine.host_pool

        def take_out(start, slots, op):
            for j in range(op.completed_pages):
                self._copy(host_page_view(self.mem_pool_host, int(pages[start + j]), self.is_mla),
                           pool.page_view(slots[j]))

        ok = self._through_staging(keys, write=False, take_out=take_out, stop_short=True)
        return gilkeep.first_false(ok)

    def _staged_set(self, keys, pages) -> np.ndarray:
        pool = self._staging_path().engine.host_pool

        def fill(start, slots):
            for j, slot in enumerate(slots):
                self._copy(pool.page_view(slot),
                           host_page_view(self.mem_pool_host, int(pages[start + j]), self.is_mla))

        return self._through_staging(keys, write=True, fill=fill)

    def _wait_on(self, eng: PrefetchEngine, op: Op) -> None:
        """Block (semaphore, GIL released; never a spin) until the op is done. Past
        io_timeout_s the op is abandoned: pages not done end False, and this returns
        only once no worker can write their slots any more (a stuck one is killed
        and replaced), because SGLang reuses those slots as soon as we return."""
        if self.io_timeout_s is None:
            eng.wait(op)
        elif not eng.wait(op, self.io_timeout_s):
            eng.abandon(op, grace_s=min(ABANDON_GRACE_S, self.io_timeout_s))

    def _index_written(self, keys, ok, writer: PrefetchEngine) -> None:
        """Pages written by the legacy staging engine are known to the main one too."""
        if self.engine is not None and writer is not self.engine:
            self.engine.mark_present([key for key, good in zip(keys, ok) if good])

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
        pool = self._staging_path().engine.host_pool
        g, layout = self.geometry, self.mem_pool_host.layout
        out = [None] * len(keys)
        t0 = time.perf_counter()

        def take_out(start, slots, op):
            for j in np.flatnonzero(op.page_status == st.OK).tolist():
                i = start + j
                if target_locations is not None and target_locations[i] is not None:
                    target = target_locations[i]
                else:
                    target = torch.empty(g.page_bytes // g.itemsize, dtype=getattr(torch, g.dtype))
                self._copy(flat_page_view(target, layout, g), pool.page_view(slots[j]))
                out[i] = target

        self._through_staging(keys, write=False, take_out=take_out)
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
        pool = self._staging_path().engine.host_pool
        g, layout = self.geometry, self.mem_pool_host.layout
        t0 = time.perf_counter()

        def fill(start, slots):
            for j, slot in enumerate(slots):
                flat = values[start + j].contiguous().view(-1)
                if flat.numel() * flat.element_size() != g.page_bytes:
                    raise ValueError(f"hicache_mp: a page holds {g.page_bytes} bytes, got "
                                     f"{flat.numel() * flat.element_size()}")
                self._copy(pool.page_view(slot), flat_page_view(flat, layout, g))

        ok_all = bool(self._through_staging(keys, write=True, fill=fill).all())
        self._record("backup", len(keys) if ok_all else 0, t0)
        return ok_all

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    # --- housekeeping -----------------------------------------------------------
    def clear(self) -> bool:
        """Remove every page file of the store directory (as SGLang's `file` backend
        clears its directory). Other files are left alone."""
        root = self.storage_dir
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
        with self._lock:
            out.update(self._counts)
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
        with self._lock:
            stats = {k: list(v) for k, v in self._stats.items()}
            for v in self._stats.values():
                v.clear()
        cls = _storage_metrics_class()
        if cls is None:
            return None
        m = cls()
        for k, v in stats.items():
            getattr(m, k).extend(v)
        return m

    def _record(self, kind: str, pages: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        with self._lock:
            self._counts["get_calls" if kind == "prefetch" else "set_calls"] += 1
            if not self.metrics_on:
                return
            self._stats[f"{kind}_pgs"].append(pages)
            gb = pages * (self.geometry.page_bytes if self.geometry else 0) / 1e9
            self._stats[f"{kind}_bandwidth"].append(gb / dt if dt > 0 else 0.0)

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

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
