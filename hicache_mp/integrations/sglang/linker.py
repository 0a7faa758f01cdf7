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

What it serves (`linker_pools`): dense MHA (`MHATokenToKVPool`), MLA
(`MLATokenToKVPool`), SWA models (`SWAKVPool`: the sliding window's pages as
a side pool) and Mamba hybrids (`HybridLinearKVPool`: the state slot as a
side pool). Side pools are read whole, one op per pool per batch, and land
before any layer is released (their layers interleave with the full ones);
their pages are the linker's own layout (`SidePool.describe` in the
namespace), so only the full-attention KV pages are shared with the HiCache
path. Must not: do page I/O (the workers do), copy bytes itself
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

from workers.naming import KeyRefused

from ...device.layered import LayerCopies, SlotRuns, auto_groups
from ...engine import PrefetchEngine
from ..common import check_known, engine_config, store_dirs
from ..common.options import settable_keys
from . import linker_pools
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


class PulledCounter(LayerWiseLoadCounter):
    """SGLang's counter, whose waits drive the loads: `wait_until(l)` asks the
    linker to land what layer l reads (sleeping GIL-released on the engine's
    semaphore, never spinning) and returns once the forward's stream is
    ordered after those copies. A failed batch is left for `finish()` to
    report, as SGLang's counter does."""

    def __init__(self, num_layers: int, linker: "HiCacheMPLinker"):
        super().__init__(num_layers)
        self.linker = linker

    def wait_until(self, threshold: int) -> None:
        self.linker.need_layer(self.consumer_index, threshold)


class _Side:
    """One side pool's engine, planes and slots (SWA's window, Mamba's state)."""

    def __init__(self, pool: "linker_pools.SidePool", engine: PrefetchEngine, pages: int):
        self.pool, self.engine = pool, engine
        self.free = SlotRuns(pages)


class _Request:
    """One queued load: per pool (None: KV), its keys, device rows and first slot."""

    def __init__(self, rid: str):
        self.rid = rid
        self.parts: dict = {}


class _Batch:
    """One start_layer_wise_loading: its requests, ops and copies."""

    def __init__(self, index: int, groups: int):
        self.index = index
        self.requests: list = []
        self.ops = [None] * groups     # one read op per layer group
        self.events = [None] * groups  # the group's copy, once queued
        self.side_ops: dict = {}       # side pool -> its read op
        self.side_events: dict = {}    # side pool -> its copy, once queued
        self.ready = None              # the scheduler's stream at start: it made the indices
        self.failed = None             # the first error


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
        dp = linker_pools.read(params, self.page_size, components)
        self.geometry, layers = dp.geometry, dp.geometry.num_layers
        groups = int(extra.pop("layer_groups", 0) or 0) or \
            auto_groups(layers, self.geometry.page_bytes)
        self.geometry.layer_part(groups)  # ValueError now, naming the divisors, if it does not divide
        self.groups, self.group_layers = groups, layers // groups
        self.full_layer = dp.full_layer
        self.load_pages = int(extra.pop("load_pages", 256))
        offload_pages = int(extra.pop("offload_pages", 64))
        offload_workers = int(extra.pop("offload_workers", 1))
        self.load_timeout_s = float(extra.pop("load_timeout_s", 30.0))
        if min(self.load_pages, offload_pages, offload_workers) <= 0 or \
                not self.load_timeout_s > 0:
            raise ValueError("hicache_mp linker: load_pages, offload_pages, offload_workers "
                             "and load_timeout_s must be positive")

        tp_rank, tp_size = _tp(params)
        mla = self.geometry.mla
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
        self.copies = LayerCopies(dp.planes, dp.planes[0][0].device)
        self.reader = self.writer = None
        self.side: dict = {}
        self._closed = None  # close() before everything exists closes what was made
        try:
            # The writer and the side pools' engines first, as auxiliaries of this
            # process (no scheduler core of their own in the node's budget): the
            # reader's auto count is then what they leave, and the process's
            # engines together fit the CPU budget (made after a reader that took
            # it all, each was over it, with a warning, or floored to one worker).
            fixed_workers = {k: v for k, v in extra.items() if k != "num_workers"}
            self.writer = PrefetchEngine(engine_config(
                fixed_workers, storage_dir=root, host_pool_pages=offload_pages,
                num_workers=offload_workers, **names), self.geometry,
                aux_workers=offload_workers)
            self.copies.register(self.writer.host_pool.tensor)
            for name, pool in dp.side.items():
                side_names = dict(names, namespace_extra=f"{names['namespace_extra']}"
                                  f"|linker-pool={name}|{pool.describe()}")
                pages = self.load_pages + offload_pages
                eng = PrefetchEngine(engine_config(
                    fixed_workers, storage_dir=root, host_pool_pages=pages,
                    num_workers=offload_workers, **side_names), pool.geometry(),
                    aux_workers=offload_workers)
                self.side[name] = _Side(pool, eng, pages)
                self.copies.register(eng.host_pool.tensor)
            self.reader = PrefetchEngine(engine_config(
                extra, storage_dir=root, host_pool_pages=groups * self.load_pages,
                defaults={"node_engines": node_ranks(shard)}, read_parts=groups,
                **names), self.geometry)
            self.copies.register(self.reader.host_pool.tensor)
        except BaseException:
            self.close()
            raise
        self.pools = {PoolName.KV: dp.full_pool}
        for name, side in self.side.items():
            self.pools[_POOL[name]] = side.pool.pool
        self.layer_done_counter = PulledCounter(dp.counter_layers, self)
        if "mamba" in self.side:  # Mamba's state waits on the request pool (as Mooncake's)
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self._load_free = SlotRuns(groups * self.load_pages)
        self._offload_free = SlotRuns(offload_pages)
        self._queued: dict = {}           # rid -> _Request
        self._batches: dict = {}          # counter index -> _Batch
        self._offloads = deque()          # [parts, ok]: part = [engine, runs, event, keys, first, n, op]
        self._results = deque()
        self._closed = False
        log.info("hicache_mp linker: %s, %d layers in %d groups%s, store %s, tp %d/%d%s",
                 "MLA" if mla else "MHA", layers, groups,
                 "".join(f", {n} pool" for n in self.side), root, tp_rank, tp_size,
                 "" if self.offload_owner else " (MLA: rank 0 writes)")

    # --- lookups and loads (scheduler thread) -----------------------------
    def lookup(self, rid: str, transfers) -> list[int]:
        by = _by_pool(transfers)
        kv = by.get(None)
        if kv is None or not kv.keys or any(n not in self.side for n in by if n):
            return []
        keys = list(kv.keys)
        try:
            n = self.reader.exists(keys)  # the index; unknown keys are probed by workers
        except KeyRefused:
            return []
        ok = list(range(1, n + 1))
        swa = by.get("swa")
        if swa is not None and ok:  # a length needs the window of SWA pages that ends there
            have = self.side["swa"].engine.present(keys[:n]).tolist()
            window = len(swa.keys) if len(swa.keys) < len(keys) else n
            ok = [m for m in ok if all(have[max(0, m - window):m])]
        if "mamba" in by and ok:  # and the Mamba state saved at its last page
            have = self.side["mamba"].engine.present(keys[:n]).tolist()
            ok = [m for m in ok if have[m - 1]]
        return ok

    def load(self, rid: str, transfers) -> bool:
        by = _by_pool(transfers)
        if rid in self._queued:
            raise RuntimeError(f"hicache_mp linker: a load for rid={rid} is already queued")
        if not by or any(n not in self.side for n in by if n):
            return False
        req = _Request(rid)
        for name, t in by.items():
            if t.device_indices is None or not t.keys:
                continue
            n = len(t.keys)
            per = self.page_size if name in (None, "swa") else 1
            runs = self._load_free if name is None else self.side[name].free
            first = runs.take(n * (self.groups if name is None else 1)) \
                if len(t.device_indices) == n * per else None
            if first is None:  # a full load pool: SGLang recomputes this request
                self._give_back(req)
                return False
            req.parts[name] = (list(t.keys), t.device_indices, first)
        if not req.parts:
            return False
        self._queued[rid] = req
        return True

    def _give_back(self, req: _Request) -> None:
        for name, (keys, _rows, first) in req.parts.items():
            if name is None:
                self._load_free.give(first, len(keys) * self.groups)
            else:
                self.side[name].free.give(first, len(keys))

    def cancel_queued_load(self, rid: str) -> bool:
        req = self._queued.pop(rid, None)
        if req is None:
            return False
        self._give_back(req)
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._queued:
            return -1
        index = self.layer_done_counter.update_producer()
        batch = _Batch(index, self.groups)
        batch.requests = list(self._queued.values())
        self._queued = {}
        self._batches[index] = batch
        if self.copies.cuda:  # the slots' indices were made on the scheduler's stream
            batch.ready = torch.cuda.Event()
            batch.ready.record()
        try:
            for name, side in self.side.items():
                keys, slots = self._batch_pages(batch, name, 0, 1)
                if keys:
                    batch.side_ops[name] = side.engine.prefetch(keys, slots,
                                                                policy="wait_complete")
            for g in range(self.groups):  # group-major: every worker reads group 0 first
                keys, slots = self._batch_pages(batch, None, g, self.groups)
                if keys:
                    batch.ops[g] = self.reader.prefetch(
                        keys, slots, parts=[g] * len(keys) if self.groups > 1 else None,
                        policy="wait_complete")
        except Exception as exc:  # refused before any byte moved: fail the batch, not the server
            batch.failed = exc
            log.error("hicache_mp linker: load batch %d not started: %s", index, exc)
        return index

    @staticmethod
    def _batch_pages(batch: _Batch, name, g: int, groups: int) -> tuple[list, list]:
        """The keys and slots of group g of pool `name` over the batch's requests."""
        keys, slots = [], []
        for req in batch.requests:
            if name in req.parts:
                ks, _rows, first = req.parts[name]
                n = len(ks)
                keys.extend(ks)
                slots.extend(range(first + g * n, first + (g + 1) * n))
        return keys, slots

    def need_layer(self, index: int, layer: int) -> None:
        """The forward's wait for `layer` of batch `index` (PulledCounter)."""
        batch = self._batches.get(index)
        if batch is None or batch.failed is not None:
            return
        events = self._land_sides(batch)
        local = self.full_layer.get(layer)
        if local is not None:
            g = local // self.group_layers
            self._land(batch, g)
            events.append(batch.events[g])
        if self.copies.cuda:
            stream = torch.cuda.current_stream()
            for ev in events:
                if ev is not None:
                    stream.wait_event(ev)
        self._issue_landed(batch)  # later groups that landed meanwhile go now

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        batch = self._batches.pop(counter_index, None)
        counter = self.layer_done_counter
        if batch is None:
            return counter.finish(counter_index)
        self._land_sides(batch)
        for g in range(self.groups):
            self._land(batch, g)
        for ev in [*batch.events, *batch.side_events.values()]:
            if ev is not None:
                ev.synchronize()  # the device rows are written before SGLang uses or frees them
        pending = [(self.reader, op) for op in batch.ops] + \
            [(self.side[n].engine, op) for n, op in batch.side_ops.items()]
        for eng, op in pending:
            if op is not None and not op.done:
                eng.abandon(op)  # nothing may write the slots once they are given back
        if batch.failed is None:
            for layer in range(counter.num_layers):
                counter.complete(counter_index, layer)
        else:
            counter.fail(counter_index, batch.failed)
        for req in batch.requests:
            self._give_back(req)
        return counter.finish(counter_index)

    def _wait_ok(self, batch: _Batch, engine, op, what: str) -> bool:
        if op is None:
            return True
        if not op.done:
            engine.wait(op, self.load_timeout_s)
        if op.done and op.status == "ok":
            return True
        why = "timed out after %.0f s" % self.load_timeout_s if not op.done \
            else f"pages {op.status_counts()}"
        batch.failed = LinkerError(f"hicache_mp linker: {what} of batch {batch.index}: {why}")
        log.error("%s", batch.failed)
        return False

    def _land_sides(self, batch: _Batch) -> list:
        """Every side pool's pages read and their copies queued; the copies' events."""
        for name, op in batch.side_ops.items():
            if name in batch.side_events or batch.failed is not None:
                continue
            side = self.side[name]
            if not self._wait_ok(batch, side.engine, op, f"the {name} pool"):
                break
            host, last = side.engine.host_pool.tensor, None
            for req in batch.requests:
                if name in req.parts:
                    keys, rows, first = req.parts[name]
                    last = self.copies.load_rows(host, first, len(keys), side.pool.planes,
                                                 side.pool.rows_per_page, rows, after=batch.ready)
            batch.side_events[name] = last
        return list(batch.side_events.values())

    def _land(self, batch: _Batch, g: int) -> None:
        """Group g of `batch` read and its copy queued, or `batch.failed` set."""
        if batch.events[g] is not None or batch.failed is not None:
            return
        if not self._wait_ok(batch, self.reader, batch.ops[g], f"layer group {g}"):
            return
        host = self.reader.host_pool.tensor
        layer0 = g * self.group_layers
        last = None
        for req in batch.requests:
            if None in req.parts:
                keys, tokens, first = req.parts[None]
                n = len(keys)
                last = self.copies.load(host, first + g * n, n, layer0, tokens,
                                        after=batch.ready)
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
        by = _by_pool(transfers)
        kv = by.get(None)
        if kv is None or kv.device_indices is None or not kv.keys or \
                any(n not in self.side for n in by if n):
            return False
        if not self.offload_owner:
            self._results.append(True)  # MLA: rank 0 writes the pages every rank holds
            return True
        parts, ready = [], None
        for name, t in by.items():
            if t.device_indices is None or not t.keys:
                continue
            keys = list(t.keys)
            eng = self.writer if name is None else self.side[name].engine
            if all(eng.present(keys)):
                continue  # stored already (by this path, or HiCache's for the KV pages)
            n = len(keys)
            per = self.page_size if name in (None, "swa") else 1
            runs = self._offload_free if name is None else self.side[name].free
            first = runs.take(n) if len(t.device_indices) == n * per else None
            if first is None:  # offloads in flight fill the pool: shed, never queued
                for p in parts:
                    p[1].give(p[4], p[5])
                return False
            if ready is None:
                ready = self.record_offload_ready()
            host = eng.host_pool.tensor
            if name is None:
                event = self.copies.store(host, first, n, t.device_indices, ready)
            else:
                side = self.side[name].pool
                event = self.copies.store_rows(host, first, n, side.planes, side.rows_per_page,
                                               t.device_indices, ready)
            parts.append([eng, runs, event, keys, first, n, None])
        self._offloads.append([parts, True])
        return True

    def _advance_offloads(self) -> None:
        """Backups of copied offloads started; finished offloads counted, in order."""
        while self._offloads:
            job = self._offloads[0]
            parts = job[0]
            for part in parts:
                eng, _runs, event, keys, first, n, op = part
                if op is None:
                    if not event.query():
                        return
                    try:
                        part[6] = eng.backup(keys, range(first, first + n))
                    except Exception as exc:
                        log.error("hicache_mp linker: offload of %d pages not written: %s",
                                  n, exc)
                        part[6] = False
            for part in parts:
                op = part[6]
                if op is False:
                    job[1] = False
                    continue
                if not op.done:
                    part[0].poll()
                if not op.done:
                    return
                if op.status != "ok":
                    job[1] = False
                elif part[0] is self.writer:
                    self.reader.mark_present(part[3])  # found by the next lookup
            self._offloads.popleft()
            for part in parts:
                part[1].give(part[4], part[5])
            self._results.append(job[1])

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
        for parts, _ok in self._offloads:
            for eng, _runs, event, _keys, _first, _n, op in parts:
                event.synchronize()
                if op not in (None, False) and not op.done:
                    eng.wait(op, self.load_timeout_s)
                    if not op.done:
                        eng.abandon(op)
        self._advance_offloads()
        for parts, _ok in self._offloads:  # copies that never started a backup
            for part in parts:
                part[1].give(part[4], part[5])
        self._offloads.clear()
        self._results.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        if self._closed is False:
            try:
                self.reset()
            except Exception as exc:  # closing must go on: the engines hold processes
                log.warning("hicache_mp linker: reset before close failed: %s", exc)
        self._closed = True
        self.copies.close()
        for eng in [self.reader, self.writer, *(s.engine for s in self.side.values())]:
            if eng is not None:
                eng.close()

    def worker_pids(self) -> dict:
        """Each engine's worker processes: reader, writer and one per side pool."""
        out = {"reader": self.reader.worker_pids(), "writer": self.writer.worker_pids()}
        out.update({name: s.engine.worker_pids() for name, s in self.side.items()})
        return out

    def metrics(self) -> dict:
        """Each engine's metrics, for operators."""
        out = {"reader": self.reader.metrics(), "writer": self.writer.metrics(),
               "groups": self.groups}
        out.update({name: s.engine.metrics() for name, s in self.side.items()})
        return out


_POOL = {"swa": PoolName.SWA, "mamba": PoolName.MAMBA}
_NAME = {PoolName.KV: None, PoolName.SWA: "swa", PoolName.MAMBA: "mamba"}


def _by_pool(transfers) -> dict:
    """Transfers by side-pool name (None: the KV pool); another pool by its own name."""
    return {_NAME.get(t.name, str(t.name)): t for t in transfers}


class _ModelName:
    """What server_identity reads of a storage config: the model's path."""

    def __init__(self, server_args):
        self.model_name = getattr(server_args, "model_path", None)


def _tp(params) -> tuple[int, int]:
    """This rank's place in its attention TP group, as the Mooncake linker reads it."""
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return (torch.distributed.get_rank(group=group),
                torch.distributed.get_world_size(group=group))
    return 0, 1


__all__ = ["HiCacheMPLinker", "PulledCounter", "LinkerError", "OWN_KEYS"]
