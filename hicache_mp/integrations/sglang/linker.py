"""HiCacheMPLinker: hicache_mp as SGLang's direct L3 linker (decision 101).

SGLang 0.5.23's `UnifiedRadixCache` can load a cached prefix from an external
store straight into its device KV pools, layer by layer, through a
`UnifiedCacheLinker`; the forward waits per layer on `layer_done_counter`.
This linker serves it from page files:

    lookup(rid, [KV keys])   ─► reader.exists(): the engine's index, no syscall
    load(rid, transfers)     ─► slots reserved, the request queued (no I/O yet)
    start_layer_wise_loading ─► one read op per layer group (read_parts): the
                                workers read group g of every page into slots
    forward: wait_until(l)   ─► sleeps (GIL released) until l's group landed,
                                queues its copy on the load stream, and makes
                                the forward's stream wait for it on the GPU
    finish_layer_wise_loading ─► every group copied (or failed): landed or not
    offload(transfers)       ─► after record_offload_ready()'s events, D2H on
                                the store stream into the writer's slots; once
                                copied, writer.backup() (temp file + rename)

Pages are the HiCache backend's pages: the same key (SGLang's page hash), the
same namespace (`SGLangShard`: model, TP rank unless MLA, PP/CP suffixes, the
weights' identity) and the same whole-page file, so a prefix stored by either
path is found by the other when the geometry matches. Two engines share that
store: the reader (`read_parts` layer groups, a slot per group) and the writer
(whole pages). There is no thread of ours in the scheduler's process: work
advances when SGLang calls in (the forward's waits, the scheduler's offload
checks), so a busy scheduler loses nothing to a thread of ours.

What it serves: dense MHA (`MHATokenToKVPool`), MLA (`MLATokenToKVPool`) and
the full-attention layers of SWA models (`SWAKVPool`; SGLang tombstones the
SWA window itself when a linker has no SWA pool). Mamba state is not served:
lookup answers no hit where a MAMBA transfer is asked, so such a model
recomputes. Must not: do page I/O (the workers do), copy bytes itself
(`device.layered` does), or read another object's private fields.
"""
from __future__ import annotations

import logging
from collections import deque

import torch

try:
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        LayerWiseLoadCounter, UnifiedCacheLinker)
except ImportError as _exc:
    # In a server SGLang's own stack is installed; a CPU box with SGLang but no
    # torchvision (its configs import it) cannot load the tree's modules.
    raise ImportError(
        "hicache_mp.integrations.sglang.linker is SGLang's direct L3 linker and needs SGLang "
        "0.5.23 with what its unified radix cache imports (sglang.srt.mem_cache.unified_cache"
        f" could not be imported: {_exc})") from _exc

from shm import PageGeometry
from workers.naming import KeyRefused

from ...device.layered import LayerCopies
from ...engine import PrefetchEngine
from ..common import check_known, engine_config, store_dirs
from ..common.options import settable_keys
from .backend import node_ranks, server_identity
from .names import SGLangShard
from .settings import storage_dir

log = logging.getLogger("hicache_mp")

# The linker's own extra-config keys, beside every engine setting (num_workers, ...).
OWN_KEYS = {
    "storage_dir": "the store's directory (or several, comma-separated); else "
                   "$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache_mp",
    "namespace": "who shares pages: replaces the weights' identity (decision 91)",
    "layer_groups": "read each page in this many layer groups (a divisor of the layers; "
                    "0 = auto: groups of at least 1 MiB, at most 8)",
    "load_pages": "pages one batch of loads may hold in shared memory (default 256)",
    "offload_pages": "pages of offloads in flight (default 64)",
    "offload_workers": "the writer engine's workers (default 1)",
    "load_timeout_s": "a batch whose reads take longer fails, and SGLang recomputes (30)",
}


class LinkerError(RuntimeError):
    """Why a load batch did not land: the pages' statuses."""


def device_planes(params) -> tuple[list, int, bool, object]:
    """(planes[kv][layer], store dtype, mla, device pool) of the KV pool the
    linker serves; ValueError naming what it serves for anything else."""
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    pool = getattr(kvcache, "full_kv_pool", kvcache)  # SWAKVPool: its full-attention layers
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        return [list(pool.k_buffer), list(pool.v_buffer)], pool.k_buffer[0].dtype, False, pool
    if hasattr(pool, "kv_buffer"):
        return [list(pool.kv_buffer)], pool.kv_buffer[0].dtype, True, pool
    raise ValueError(
        f"hicache_mp's linker serves dense MHA and MLA KV pools (SGLang's MHATokenToKVPool, "
        f"MLATokenToKVPool, and SWAKVPool's full-attention layers); {type(kvcache).__name__} "
        "is not one of them. Use --enable-hierarchical-cache with --hicache-storage-backend "
        "dynamic and hicache_mp's HiCache backend for other pools")


def auto_groups(layers: int, page_bytes: int) -> int:
    """The most layer groups (at most 8) that divide `layers` and keep a group's
    reads at 1 MiB or more: smaller reads cost more in opens than they gain."""
    best = 1
    for g in range(1, min(8, layers) + 1):
        if layers % g == 0 and page_bytes // g >= (1 << 20):
            best = g
    return best


class PulledCounter(LayerWiseLoadCounter):
    """SGLang's counter, whose waits drive the loads: `wait_until(l)` asks the
    linker to land layer l's group (sleeping GIL-released on the engine's
    semaphore, never spinning) and returns once the forward's stream is
    ordered after that group's copy. A failed group is left for `finish()`
    to report, as SGLang's counter does."""

    def __init__(self, num_layers: int, linker: "HiCacheMPLinker"):
        super().__init__(num_layers)
        self.linker = linker

    def wait_until(self, threshold: int) -> None:
        self.linker.need_layer(self.consumer_index, threshold)


class _Batch:
    """One start_layer_wise_loading: its requests' pages, slots, ops and copies."""

    def __init__(self, index: int, groups: int):
        self.index = index
        self.requests = []            # (rid, keys, tokens, first slot)
        self.ops = [None] * groups    # one read op per layer group
        self.ready = None             # the scheduler's stream at start: it made the indices
        self.events = [None] * groups  # the group's copy, once queued
        self.failed = None            # the first error


class HiCacheMPLinker(UnifiedCacheLinker):
    def __init__(self, server_args, params, *, components, extra_config=None,
                 forward_stream=None):
        extra = dict(extra_config or {})
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        unknown = check_known(extra, frozenset(OWN_KEYS) | settable_keys())
        if unknown:
            raise ValueError(f"hicache_mp linker: unknown linker_extra_config key(s) {unknown}; "
                             f"known: {sorted(OWN_KEYS)} and the engine settings "
                             "(docs/flags.md)")
        planes, dtype, mla, self.device_pool = device_planes(params)
        layers = len(planes[0])
        first = planes[0][0]
        heads, dim = (1, first[0].numel()) if mla else (first.shape[1], first[0][0].numel())
        self.geometry = PageGeometry(num_layers=layers, num_kv_heads=int(heads),
                                     head_dim=int(dim), page_size=self.page_size,
                                     dtype=str(dtype).removeprefix("torch."), mla=mla)
        groups = int(extra.pop("layer_groups", 0) or 0) or \
            auto_groups(layers, self.geometry.page_bytes)
        self.geometry.layer_part(groups)  # ValueError now, naming the divisors, if it does not divide
        self.groups, self.group_layers = groups, layers // groups
        self.load_pages = int(extra.pop("load_pages", 256))
        offload_pages = int(extra.pop("offload_pages", 64))
        offload_workers = int(extra.pop("offload_workers", 1))
        self.load_timeout_s = float(extra.pop("load_timeout_s", 30.0))
        if min(self.load_pages, offload_pages, offload_workers) <= 0 or \
                not self.load_timeout_s > 0:
            raise ValueError("hicache_mp linker: load_pages, offload_pages, offload_workers "
                             "and load_timeout_s must be positive")

        tp_rank, tp_size = _tp(params)
        self.replicated = mla
        self.offload_owner = not mla or tp_rank == 0  # MLA ranks hold the same pages
        shard = SGLangShard(model_name=getattr(server_args, "model_path", None),
                            tp_rank=tp_rank, tp_size=tp_size,
                            pp_rank=int(getattr(params, "pp_rank", 0) or 0),
                            pp_size=int(getattr(params, "pp_size", 1) or 1),
                            attn_cp_rank=int(getattr(params, "attn_cp_rank", 0) or 0),
                            attn_cp_size=int(getattr(params, "attn_cp_size", 1) or 1),
                            is_mla=mla,
                            identity=server_identity(_ModelName(server_args), extra))
        extra.pop("namespace", None)
        root = store_dirs(storage_dir(extra), log=log, who="hicache_mp linker")
        extra.pop("storage_dir", None)
        names = shard.engine_names()
        device = first.device
        self.copies = LayerCopies(planes, device)
        self.reader = self.writer = None
        try:
            self.reader = PrefetchEngine(engine_config(
                extra, storage_dir=root, host_pool_pages=groups * self.load_pages,
                defaults={"node_engines": node_ranks(shard)}, read_parts=groups,
                **names), self.geometry)
            writer_extra = {k: v for k, v in extra.items() if k != "num_workers"}
            self.writer = PrefetchEngine(engine_config(
                writer_extra, storage_dir=root, host_pool_pages=offload_pages,
                num_workers=offload_workers, **names), self.geometry)
            self.copies.register(self.reader.host_pool.tensor)
            self.copies.register(self.writer.host_pool.tensor)
        except BaseException:
            self.close()
            raise
        self.pools = {PoolName.KV: self.device_pool}
        self.layer_done_counter = PulledCounter(layers, self)
        self._load_free = _Runs(groups * self.load_pages)
        self._offload_free = _Runs(offload_pages)
        self._queued: dict = {}           # rid -> (keys, tokens, first slot)
        self._batches: dict = {}          # counter index -> _Batch
        self._offloads = deque()          # [event, keys, tokens, first slot, n, op, result]
        self._results = deque()
        self._closed = False
        log.info("hicache_mp linker: %s, %d layers in %d groups, store %s, tp %d/%d%s",
                 "MLA" if mla else "MHA", layers, groups, root, tp_rank, tp_size,
                 "" if self.offload_owner else " (MLA: rank 0 writes)")

    # --- lookups and loads (scheduler thread) -----------------------------
    def lookup(self, rid: str, transfers) -> list[int]:
        if any(t.name == PoolName.MAMBA for t in transfers):
            return []  # Mamba state is not served (module docstring): recompute
        kv = _kv(transfers)
        if kv is None or not kv.keys:
            return []
        try:
            n = self.reader.exists(list(kv.keys))  # the index; unknown keys are probed by workers
        except KeyRefused:
            return []
        return list(range(1, n + 1))

    def load(self, rid: str, transfers) -> bool:
        kv = _kv(transfers)
        if kv is None or kv.device_indices is None or not kv.keys:
            return False
        if rid in self._queued:
            raise RuntimeError(f"hicache_mp linker: a load for rid={rid} is already queued")
        n = len(kv.keys)
        if len(kv.device_indices) != n * self.page_size:
            return False
        first = self._load_free.take(n * self.groups)
        if first is None:
            return False  # the load pool is full: SGLang recomputes this request
        self._queued[rid] = (list(kv.keys), kv.device_indices, first)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        queued = self._queued.pop(rid, None)
        if queued is None:
            return False
        self._load_free.give(queued[2], len(queued[0]) * self.groups)
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._queued:
            return -1
        index = self.layer_done_counter.update_producer()
        batch = _Batch(index, self.groups)
        batch.requests = [(rid, *q) for rid, q in self._queued.items()]
        self._queued = {}
        self._batches[index] = batch
        if self.copies.cuda:  # the slots' indices were made on the scheduler's stream
            batch.ready = torch.cuda.Event()
            batch.ready.record()
        # The slots may still be read by an earlier batch's copy: the copy event
        # of a finished batch was waited for in finish(), so they are free.
        try:
            for g in range(self.groups):
                keys, slots = [], []
                for _rid, ks, _tokens, first in batch.requests:
                    n = len(ks)
                    keys.extend(ks)
                    slots.extend(range(first + g * n, first + (g + 1) * n))
                batch.ops[g] = self.reader.prefetch(
                    keys, slots, parts=[g] * len(keys) if self.groups > 1 else None,
                    policy="wait_complete")
        except Exception as exc:  # refused before any byte moved: fail the batch, not the server
            batch.failed = exc
            log.error("hicache_mp linker: load batch %d not started: %s", index, exc)
        return index

    def need_layer(self, index: int, layer: int) -> None:
        """The forward's wait for `layer` of batch `index` (PulledCounter)."""
        batch = self._batches.get(index)
        if batch is None or batch.failed is not None:
            return
        g = layer // self.group_layers
        self._land(batch, g)
        ev = batch.events[g]
        if ev is not None and self.copies.cuda:
            torch.cuda.current_stream().wait_event(ev)
        self._issue_landed(batch)  # later groups that landed meanwhile go now

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        batch = self._batches.pop(counter_index, None)
        if batch is None:
            return self.layer_done_counter.finish(counter_index)
        for g in range(self.groups):
            if batch.failed is None:
                self._land(batch, g)
        for g, ev in enumerate(batch.events):
            if ev is not None:
                ev.synchronize()  # the device rows are written before SGLang uses or frees them
        for g, op in enumerate(batch.ops):
            if op is not None and not op.done:
                self.reader.abandon(op)
        counter = self.layer_done_counter
        for layer in range(self.geometry.num_layers):
            g = layer // self.group_layers
            if batch.failed is None and batch.events[g] is not None:
                counter.complete(counter_index, layer)
        if batch.failed is not None:
            counter.fail(counter_index, batch.failed)
        for _rid, keys, _tokens, first in batch.requests:
            self._load_free.give(first, len(keys) * self.groups)
        return counter.finish(counter_index)

    def _land(self, batch: _Batch, g: int) -> None:
        """Group g of `batch` read and its copy queued, or `batch.failed` set."""
        if batch.events[g] is not None or batch.failed is not None:
            return
        op = batch.ops[g]
        if not op.done:
            self.reader.wait(op, self.load_timeout_s)
        if not op.done or op.status != "ok":
            why = "timed out after %.0f s" % self.load_timeout_s if not op.done \
                else f"pages {op.status_counts()}"
            batch.failed = LinkerError(f"hicache_mp linker: layer group {g} of batch "
                                       f"{batch.index}: {why}")
            log.error("%s", batch.failed)
            return
        host = self.reader.host_pool.tensor
        layer0 = g * self.group_layers
        last = None
        for _rid, keys, tokens, first in batch.requests:
            n = len(keys)
            last = self.copies.load(host, first + g * n, n, layer0, tokens, after=batch.ready)
        batch.events[g] = last

    def _issue_landed(self, batch: _Batch) -> None:
        if batch.failed is not None:
            return
        self.reader.poll()
        for g in range(self.groups):
            op = batch.ops[g]
            if batch.events[g] is None and op is not None and op.done:
                self._land(batch, g)

    # --- offloads ---------------------------------------------------------
    def offload(self, transfers, session_id=None) -> bool:
        kv = _kv(transfers)
        if kv is None or kv.device_indices is None or not kv.keys:
            return False
        if not self.offload_owner:
            self._results.append(True)  # MLA: rank 0 writes the pages every rank holds
            return True
        keys = list(kv.keys)
        n = len(keys)
        if len(kv.device_indices) != n * self.page_size:
            return False
        if all(self.writer.present(keys)):
            self._results.append(True)  # stored already (by this path or HiCache's)
            return True
        first = self._offload_free.take(n)
        if first is None:
            return False  # offloads in flight fill the pool: this one is shed, never queued
        event = self.copies.store(self.writer.host_pool.tensor, first, n, kv.device_indices,
                                  self.record_offload_ready())
        self._offloads.append([event, keys, first, n, None])
        return True

    def _advance_offloads(self) -> None:
        if not self._offloads:
            return
        self.writer.poll()
        while self._offloads:
            job = self._offloads[0]
            event, keys, first, n, op = job
            if op is None:
                if not event.query():
                    return
                try:
                    job[4] = op = self.writer.backup(keys, range(first, first + n))
                except Exception as exc:
                    log.error("hicache_mp linker: offload of %d pages not written: %s", n, exc)
                    self._finish_offload(first, n, False)
                    continue
            if not op.done:
                return
            if op.status == "ok":
                self.reader.mark_present(keys)  # the reader's index: found by the next lookup
            self._finish_offload(first, n, op.status == "ok")

    def _finish_offload(self, first: int, n: int, ok: bool) -> None:
        self._offloads.popleft()
        self._offload_free.give(first, n)
        self._results.append(ok)

    def num_completed_offloads(self) -> int:
        self._advance_offloads()
        return len(self._results)

    def pop_completed_offload(self) -> bool:
        return self._results.popleft()

    # --- lifecycle --------------------------------------------------------
    def reset(self) -> None:
        """Quiesce: every batch finished (its copies done), every offload written
        or given up, the queues empty; the engines and the store stay."""
        for index in list(self._batches):
            self.finish_layer_wise_loading(index)
        for rid in list(self._queued):
            self.cancel_queued_load(rid)
        while self._offloads:
            event, _keys, first, n, op = self._offloads[0]
            event.synchronize()
            if op is not None and not op.done:
                self.writer.wait(op, self.load_timeout_s)
            self._advance_offloads()
            if self._offloads and self._offloads[0][4] is op and op is not None and not op.done:
                self.writer.abandon(op)
                self._finish_offload(first, n, False)
        self._results.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        if getattr(self, "_closed", True) is False:
            try:
                self.reset()
            except Exception as exc:  # closing must go on: the engines hold processes
                log.warning("hicache_mp linker: reset before close failed: %s", exc)
        self._closed = True
        self.copies.close()
        for eng in (self.reader, self.writer):
            if eng is not None:
                eng.close()

    def worker_pids(self) -> dict:
        """The reader's and the writer's worker processes, by engine."""
        return {"reader": self.reader.worker_pids(), "writer": self.writer.worker_pids()}

    def metrics(self) -> dict:
        """The two engines' metrics, for operators."""
        return {"reader": self.reader.metrics(), "writer": self.writer.metrics(),
                "groups": self.groups}


class _ModelName:
    """What server_identity reads of a storage config: the model's path."""

    def __init__(self, server_args):
        self.model_name = getattr(server_args, "model_path", None)


class _Runs:
    """Free slot runs of a pool: first fit, neighbours merged when given back."""

    def __init__(self, size: int):
        self.free = [(0, size)]

    def take(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[i] = (start + n, length - n)
                if length == n:
                    del self.free[i]
                return start
        return None

    def give(self, start: int, n: int) -> None:
        runs = sorted(self.free + [(start, n)])
        merged = [runs[0]]
        for s, length in runs[1:]:
            ps, pl = merged[-1]
            if ps + pl == s:
                merged[-1] = (ps, pl + length)
            else:
                merged.append((s, length))
        self.free = merged


def _kv(transfers):
    for t in transfers:
        if t.name == PoolName.KV:
            return t
    return None


def _tp(params) -> tuple[int, int]:
    """This rank's place in its attention TP group, as the Mooncake linker reads it."""
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return (torch.distributed.get_rank(group=group),
                torch.distributed.get_world_size(group=group))
    return 0, 1


__all__ = ["HiCacheMPLinker", "PulledCounter", "LinkerError", "OWN_KEYS"]
