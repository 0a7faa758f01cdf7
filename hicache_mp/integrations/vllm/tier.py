"""hicache_mp as a vLLM KV-offloading secondary tier (vLLM's TieringOffloadingSpec).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 68719476736,
            "secondary_tiers": [{"type": "HiCacheMPTier",
                                 "module_path": "hicache_mp.integrations.vllm",
                                 "storage_dir": "/mnt/nvme0/kv,/mnt/nvme1/kv",
                                 "storage_max_bytes": "2T"}]}}'

vLLM's SecondaryTierFactory builds `HiCacheMPTier(offloading_spec=,
primary_kv_view=, tier_type=, backpressure_detector=, **rest of the dict)`.
`primary_kv_view` is a (num_chunks, row_bytes) memoryview over vLLM's CPU
tier, the shared mmap of /dev/shm/vllm_offload_<engine_id>.mmap. The engine
maps that same file in its worker processes (found through /proc/self/maps,
integrations.common.mapping) and they preadv/pwritev page files straight into
and out of its rows: zero copy, no staging pool, no page byte in this process.
One engine page is one row (a flat uint8 geometry of row_bytes).

vLLM calls every method on its scheduler thread, under its manager lock, and
none may block: submit_store/submit_load check a job and queue it; at the
step's end (on_schedule_end, which vLLM calls right after submitting the
step's promotions and cascades; also get_finished_jobs, drain_jobs, shutdown)
the step's loads go to the engine as one op and its stores as another
(engine.prefetch / engine.backup: one wake-up per worker and bulk drains per
step, not per job). get_finished_jobs polls the engine lazily
(engine.poll(lazy=True): counter loads, and a bulk drain once an op may be
done; decision 88) and answers for the jobs of every op that is done,
together: a row is never reported while the engine still holds it. lookup
answers from the engine's in-memory index (lookup). Only drain_jobs and
shutdown wait, as vLLM's contract says.

Capacity (storage_max_bytes, storage_min_free_bytes: LRU eviction by a
separate process), several directories (storage_dir as a comma-separated
string or a list), checksums and the stall watchdog are the engine's, set from
the same keys as for SGLang. With auto workers (num_workers 0) the engine
counts one engine per data-parallel replica on the node (node_engines(): vLLM
builds a tier per replica, in its scheduler's process), as SGLang's adapter
counts its ranks, so replicas split the node's CPUs whichever starts first.
Keys: vLLM's OffloadKey bytes as hex, in a
namespace made from vLLM's own FileMapper identity (model, parallel layout,
dtype, groups) and the row size, so instances share pages exactly when vLLM's
`fs` tier would let them. Tested with vLLM 0.33.0 (`.ci/vllm-requirements.txt`).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import numpy as np

from shm import PageGeometry, gilkeep
from workers import status as st
from workers.naming import KeyRefused

from ...engine import EngineClosed, PrefetchEngine
from ...engine.config import parse_bool, parse_value, setting, settings
from ..common import RegionNotShared, check_known, engine_config, engine_key, engine_keys, \
    file_region, model_identity, open_region, own_settings, settable_keys, store_dirs, \
    wait_or_abandon
from .api import JobResult, Locality, LookupResult, Medium, OffloadingEvent, \
    RequestOffloadingContext, SecondaryTierManager, TransferJob
from .lookup import Lookups

log = logging.getLogger("hicache_mp.vllm")

_VERDICT = {"hit": LookupResult.HIT, "miss": LookupResult.MISS, "retry": LookupResult.RETRY}
# A step's jobs of one kind go to the engine as ops of at most this many pages:
# the engine's calls keep the GIL on ops of up to a few hundred pages
# (decision 74's limits), and SGLang's batches, which it is tuned for, are 128.
STEP_OP_PAGES = 256
# A plain int: numpy compares against an IntEnum member through the enum's
# metaclass attribute lookups (microseconds per call on Python 3.11).
_OK = int(st.OK)


@dataclass
class TierSettings:
    """This tier's own keys, declared as the engine's are (hicache_mp.engine.config)."""
    drain_timeout_s: float = setting(math.inf, "drain_jobs() waits this long per job, then "
                                     "abandons it (its unfinished pages fail; a stuck worker "
                                     "is killed and replaced)", sglang=True, lo=0,
                                     lo_open=True, finite=False)

    def __post_init__(self):
        for f in settings(type(self)):
            setattr(self, f.name, parse_value(f, getattr(self, f.name)))


# Keys of the tier dict that vLLM itself reads (SecondaryTierFactory pops type,
# module_path and backpressure; locality is also passed on to the tier).
VLLM_OWN_KEYS = frozenset({"type", "module_path", "backpressure"})
TIER_KEYS = frozenset({"storage_dir", "locality", "enable_kv_events"})


def tier_flag(key: str, value) -> bool:
    """A boolean key of the tier dict, parsed as the engine's are (engine.config.parse_bool)."""
    try:
        return parse_bool(value)
    except ValueError as exc:
        raise ValueError(f'hicache_mp vLLM tier: "{key}": {exc}') from None


def tier_locality(value):
    """vLLM's Locality for the tier dict's `locality` (None: not set)."""
    if value is None:
        return None
    try:
        return Locality(value)
    except ValueError:
        raise ValueError(f'hicache_mp vLLM tier: "locality" {value!r} is not one of '
                         f"{[m.value for m in Locality]}") from None


def row_geometry(row_bytes: int) -> PageGeometry:
    """One engine page per vLLM CPU-tier row: `row_bytes` opaque bytes."""
    return PageGeometry(num_layers=1, num_kv_heads=1, head_dim=int(row_bytes), page_size=1,
                        dtype="uint8", mla=True)


@dataclass(slots=True)
class _Job:
    job_id: int
    load: bool
    keys: list                # vLLM's keys, in the job's order
    op: object = None         # the engine op (None: nothing to move)
    pos: np.ndarray = None    # the job positions its pages of the op are (None: all, in order)
    done_ok: np.ndarray = None  # per job position: settled ok without the op (stores)
    lo: int = 0               # the op's pages [lo, hi) are this job's (one op per step)
    hi: int = 0
    ekeys: list = None        # until the step's op starts: what it moves
    rows: np.ndarray = None


class HiCacheMPTier(SecondaryTierManager):
    """See the module docstring. Extra keys: `storage_dir` (required), `locality`,
    `enable_kv_events`, `drain_timeout_s`, and every engine setting an adapter
    may set (num_workers, storage_max_bytes, write_checksum, direct_io, ...).
    An unknown key is a ValueError: the dict is this tier's alone."""

    medium = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, *, storage_dir=None, locality: str | None = None,
                 enable_kv_events: bool = False, **options):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        unknown = check_known(options, settable_keys(TierSettings))
        if unknown:
            raise ValueError(f"hicache_mp vLLM tier: unknown key(s) {unknown} (known: "
                             f"{', '.join(sorted(TIER_KEYS | settable_keys(TierSettings)))})")
        if not storage_dir:
            raise ValueError('hicache_mp vLLM tier: "storage_dir" is required (a directory, '
                             'a comma-separated list of them, or a list)')
        storage_dir = store_dirs(storage_dir, log=log, who="hicache_mp vLLM tier")
        self.own = own_settings(TierSettings, options)
        self.locality = tier_locality(locality)
        # parsed as every boolean key is: the string "false" is truthy
        self.events = [] if tier_flag("enable_kv_events", enable_kv_events) and getattr(
            offloading_spec.kv_events_config, "enable_kv_cache_events", False) else None
        self.row_bytes = self.block_size_bytes
        self.num_chunks = int(primary_kv_view.shape[0])
        if primary_kv_view.nbytes != self.num_chunks * self.row_bytes:
            raise ValueError(f"hicache_mp vLLM tier: primary_kv_view {primary_kv_view.shape} "
                             f"with strides {primary_kv_view.strides} is not whole rows")
        try:
            region = file_region(primary_kv_view)
            fd = open_region(region)
        except RegionNotShared as exc:
            raise ValueError(f"hicache_mp vLLM tier: the CPU tier's memory must be a shared "
                             f"file mapping (vLLM's /dev/shm/vllm_offload_*.mmap) so workers "
                             f"can map it: {exc}") from None
        try:
            cfg = engine_config(options, storage_dir=storage_dir,
                                host_pool_pages=self.num_chunks,
                                defaults={"node_engines": node_engines(offloading_spec)},
                                **namespace(offloading_spec))
            self.engine = PrefetchEngine(cfg, row_geometry(self.row_bytes),
                                         pool_parts=[(fd, region.offset, self.row_bytes)])
        finally:
            os.close(fd)  # the engine keeps its own dup
        self.region = region
        self._lookups = Lookups(self.engine)
        self._jobs: dict[int, _Job] = {}      # submitted, not yet reported
        # This step's jobs, one op per kind at the step's end (_flush); then the
        # ops in flight with their jobs, reported together once the op is done.
        self._step: dict[bool, list[_Job]] = {True: [], False: []}
        self._ops: list[tuple[object, list[_Job]]] = []
        self._finished: list[JobResult] = []   # jobs settled at submit (nothing to move)
        self._busy = gilkeep.zeros(self.num_chunks, bool)  # rows an op in flight names
        self._warned: set = set()
        log.info("hicache_mp: vLLM tier %r zero-copy over %s (%d rows of %d bytes, %d workers, "
                 "node_engines %d, store %s)", tier_type, region.path, self.num_chunks,
                 self.row_bytes, self.engine.worker_count(), cfg.node_engines, cfg.storage_dir)

    # --- lookups ----------------------------------------------------------------
    def lookup(self, key, req_context) -> LookupResult:
        try:
            return _VERDICT[self._lookups.lookup(engine_key(key))]
        except KeyRefused as exc:  # no page file can be named after it: never stored
            self._warn("key", f"hicache_mp vLLM tier: lookup of a key the store refuses "
                              f"({exc}) is a miss")
            return LookupResult.MISS

    def on_new_request(self, req_context) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context) -> None:
        self._flush()
        self._lookups.flush()

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._finished) or self._lookups.pending

    # --- transfers --------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, ekeys, rows = self._job_input(job_metadata)
        if rows is None:
            return
        # Rows already in the store, or named by a store in flight (vLLM may cascade
        # one chunk twice), need no write: settled ok here.
        try:
            present = self.engine.present(ekeys)
        except KeyRefused as exc:  # checked before anything moves: the job fails whole
            self._warn("key", f"hicache_mp vLLM tier: store job {job_metadata.job_id} names a "
                              f"key the store refuses ({exc}); failed")
            self._finished.append(JobResult(job_id=job_metadata.job_id, success=False))
            return
        skip = gilkeep.either(present, gilkeep.take(self._busy, rows))
        job = _Job(job_metadata.job_id, False, keys, done_ok=skip)
        if gilkeep.all_(skip):
            self._settle(job)
            return
        self._start(job, ekeys, rows, gilkeep.where(skip, False) if gilkeep.any_(skip) else None)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, ekeys, rows = self._job_input(job_metadata)
        if rows is None:
            return
        busy = gilkeep.take(self._busy, rows)  # never expected: a promotion gets fresh rows
        job = _Job(job_metadata.job_id, True, keys)
        self._start(job, ekeys, rows, gilkeep.where(busy, False) if gilkeep.any_(busy) else None)

    def _job_input(self, job: TransferJob):
        keys = list(job.keys)
        ids = np.asarray(job.chunk_ids).reshape(-1).tolist()  # Python ints: no numpy cast
        if len(ids) != len(keys) or (ids and (min(ids) < 0 or max(ids) >= self.num_chunks)):
            self._warn("input", f"hicache_mp vLLM tier: job {job.job_id} has {len(keys)} keys "
                                f"and chunk ids {ids[:8]} (of {self.num_chunks} rows); failed")
            self._finished.append(JobResult(job_id=job.job_id, success=False))
            return keys, None, None
        return keys, engine_keys(keys), np.array(ids, dtype=np.int64)

    def _start(self, job: _Job, ekeys, rows, pos) -> None:
        """Queue the job for this step's op (vLLM submits a step's jobs, then calls
        on_schedule_end): one op per step and kind costs one wake-up per worker
        and drains in bulk, where an op per job costs both per job."""
        if pos is not None:
            ekeys, rows = [ekeys[i] for i in pos.tolist()], gilkeep.take(rows, pos)
        job.pos, job.ekeys, job.rows = pos, ekeys, rows
        if not len(rows):  # every row busy: nothing to move
            self._settle(job)
            return
        gilkeep.set_at(self._busy, rows, True)  # a later job of the step leaves them alone
        self._jobs[job.job_id] = job
        self._step[job.load].append(job)

    def _flush(self) -> None:
        """Start this step's ops: each kind's jobs in submit order, as ops of up
        to STEP_OP_PAGES pages (a larger job is an op of its own)."""
        for load in (True, False):
            jobs, self._step[load] = self._step[load], []
            group, pages = [], 0
            for job in jobs + [None]:
                if job is not None and pages + len(job.ekeys) <= STEP_OP_PAGES:
                    group.append(job)
                    pages += len(job.ekeys)
                    continue
                if group:
                    self._start_group(group)
                group, pages = ([job], len(job.ekeys)) if job is not None else ([], 0)

    def _start_group(self, jobs: list) -> None:
        if len(jobs) > 1:
            lo = 0
            for job in jobs:
                job.lo, job.hi = lo, lo + len(job.ekeys)
                lo = job.hi
            ekeys = [k for job in jobs for k in job.ekeys]
            rows = gilkeep.concat([job.rows for job in jobs], np.int64)
            if self._run(jobs, ekeys, rows, alone_on_error=True):
                return
        for job in jobs:  # one job, or a step's op the engine refused
            job.lo, job.hi = 0, len(job.ekeys)
            self._run([job], job.ekeys, job.rows)

    def _run(self, jobs: list, ekeys, rows, alone_on_error: bool = False) -> bool:
        """One engine op for `jobs`; False if it was refused and `alone_on_error`
        (each job then runs on its own, so one job's bad rows fail only that job)."""
        try:
            op = (self.engine.prefetch(ekeys, rows, policy="best_effort") if jobs[0].load
                  else self.engine.backup(ekeys, rows))
        except (EngineClosed, ValueError, RuntimeError) as exc:
            if alone_on_error and isinstance(exc, ValueError):
                return False
            # A closed or broken engine, or rows an op in flight still holds: the
            # jobs fail cleanly; vLLM recomputes (load) or keeps the chunk (store).
            self._warn(type(exc).__name__, f"hicache_mp vLLM tier: job(s) "
                                           f"{[j.job_id for j in jobs][:8]} failed: {exc}")
            op = None
        for job in jobs:
            job.op, job.ekeys, job.rows = op, None, None
        if op is None or op.done:  # failed, or every page settled at once (dropped, busy)
            gilkeep.set_at(self._busy, rows, False)
            for job in jobs:
                del self._jobs[job.job_id]
                self._settle(job)
        else:
            self._ops.append((op, jobs))
        return True

    def get_finished_jobs(self):
        self._flush()  # jobs submitted since the step's end (vLLM's eviction path polls too)
        out, self._finished = self._finished, []
        if not self.engine.closed:
            # lazy: this reports whole jobs, so the pages of an op are drained
            # together once it may be done (decision 88); probe answers, which
            # lookups wait for, are drained at once
            self.engine.poll(lazy=True)
        if not self._ops:
            return out
        done = [entry for entry in self._ops if entry[0].done]
        if done:
            self._ops = [entry for entry in self._ops if not entry[0].done]
            for op, jobs in done:
                gilkeep.set_at(self._busy, op.host_pages, False)
                for job in jobs:
                    del self._jobs[job.job_id]
                    out.append(self._result(job))
        return out

    def _keep(self, results) -> None:
        """Results collected outside get_finished_jobs(), reported by its next call."""
        self._finished.extend(results)  # `results` first: it swaps self._finished

    def _settle(self, job: _Job) -> None:
        self._finished.append(self._result(job))

    def _result(self, job: _Job) -> JobResult:
        n = len(job.keys)
        op = job.op
        if op is not None and op.status == "ok" and (job.pos is None or job.done_ok is not None):
            # every page of the op landed, and the job's others (a store's) were ok at submit
            seconds = (op.done_ns - op.submit_ns) / 1e9 if op.done_ns else None
            return self._success(job, seconds, (job.hi - job.lo) * self.row_bytes or None)
        ok = gilkeep.zeros(n, bool) if job.done_ok is None else gilkeep.copy(job.done_ok)
        seconds, moved = None, 0
        if op is not None:
            landed = gilkeep.eq(op.page_status[job.lo:job.hi], _OK)
            if job.pos is None:
                gilkeep.put_bytes(ok, landed)
            else:
                gilkeep.set_at(ok, job.pos, landed)
            moved = gilkeep.count(landed)
            seconds = (op.done_ns - op.submit_ns) / 1e9 if op.done_ns else None
        nbytes = moved * self.row_bytes or None
        if gilkeep.all_(ok):
            return self._success(job, seconds, nbytes)
        good = None
        if job.load and gilkeep.any_(ok):  # vLLM keeps the rows that landed
            good = tuple(job.keys[i] for i in gilkeep.where(ok).tolist())
        return JobResult(job_id=job.job_id, success=False, successful_keys=good,
                         transfer_time=seconds, transfer_bytes=nbytes)

    def _success(self, job: _Job, seconds, nbytes) -> JobResult:
        if not job.load and self.events is not None and job.keys:
            self.events.append(OffloadingEvent(keys=job.keys, medium=self.medium,
                                               removed=False, locality=self.locality))
        return JobResult(job_id=job.job_id, success=True, transfer_time=seconds,
                         transfer_bytes=nbytes)

    def take_events(self):
        if self.events:
            out, self.events = self.events, []
            return out
        return ()

    def drain_jobs(self) -> None:
        """Wait until every job is done (vLLM then reuses the rows); results stay
        for the next get_finished_jobs()."""
        timeout = None if math.isinf(self.own.drain_timeout_s) else self.own.drain_timeout_s
        self._flush()
        for op, _ in list(self._ops):
            if self.engine.closed:
                break
            wait_or_abandon(self.engine, op, timeout)
        self._keep(self.get_finished_jobs())

    def shutdown(self) -> None:
        """Let stores in flight finish (bounded), cancel loads, stop the workers
        and release every segment. vLLM's CPU-tier file is left to vLLM."""
        self._flush()  # this step's stores are flushed as the ones in flight
        self.engine.close(flush=True)
        self._keep(self.get_finished_jobs())

    # --- observability ------------------------------------------------------------
    def metrics(self) -> dict:
        out = dict(self.engine.metrics()) if not self.engine.closed else {}
        out.update(zero_copy=True, region=self.region.path, jobs_in_flight=len(self._jobs))
        return out

    def _warn(self, cause: str, msg: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            log.warning(msg + " (later ones with this cause are not logged)")


def node_engines(offloading_spec) -> int:
    """The engines this vLLM server runs on a node, which share its auto worker
    budget (hicache_mp.engine.nodebudget), as SGLang's adapter passes its
    ranks: one per data-parallel replica. vLLM builds its tiers in the
    scheduler's process (TieringOffloadingSpec.get_manager, once per replica:
    engine_id is per replica), not in its TP/PP workers, so each replica has
    one engine whatever its world size. vLLM's OffloadingConfig does not say
    how many replicas are on this node: where DP spans nodes this counts them
    all, which leaves workers unused but never over the budget; the tier's
    "node_engines" key says the node's count."""
    return max(1, int(offloading_spec.config.parallel.data_parallel_size))


def namespace(offloading_spec) -> dict:
    """The engine's key namespace for this vLLM instance: vLLM's own FileMapper
    identity (what decides whether its `fs` tier shares a directory), taken
    parallelism-agnostic as vLLM's `fs` tier takes it, and the weights' identity
    (common.identity, decision 91): vLLM's name is the model path, which two
    models served from one path share."""
    from vllm.v1.kv_offload.file_mapper import FileMapper  # vLLM's engine has it loaded
    fm = FileMapper.from_offloading_spec(root_dir="", offloading_spec=offloading_spec,
                                         blocks_per_file=offloading_spec.blocks_per_chunk,
                                         parallel_agnostic=True)
    name = offloading_spec.config.model.name
    return {"model_name": name,
            "namespace_extra": f"vllm:{os.path.basename(fm.base_path)}_r{fm.rank}"
                               f"|id={model_identity(name)}"}
