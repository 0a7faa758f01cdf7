"""The reference scheduler: one Python loop modelled on SGLang's, over one storage backend.

Owns the loop and its bookkeeping: request states, host slots, prefetch
policy checks, and the raw measurements (`records.RunResult`, with
`gputime.GpuTime`'s account of the GPU's idle time by cause); the batches
(chunked prefill and decode charged by the `ComputeModel`, write-back of
computed pages) are `batches.Batches`'. Must not do page I/O (the engine
does) nor format output (`summary`, `bench`).

Every iteration stands for one pass of SGLang 0.5.23's
`Scheduler.event_loop_normal` (managers/scheduler.py) with HiCache storage:
  1. `ingest_requests`: release requests whose arrival time has passed, FIFO,
     while fewer than `max_in_flight` are in the system (the client's cap);
  2. `_add_request_to_queue` -> `_prefetch_kvcache` -> `prefetch_from_storage`:
     look each new request up (`engine.exists` over its page chain), take host
     slots for the hit pages and start their prefetch (returns at once);
  3. `get_next_batch_to_run` -> `_process_hicache_events` ->
     `tree_cache.check_hicache_events` (here `engine.poll()`), then
     `get_new_batch_prefill` -> `check_prefetch_progress` for every waiting
     request: wait_complete waits for `done`; timeout also gives up at the
     deadline (cancel, keep the pages that landed); best_effort ends the
     prefetch when the request is scheduled, with what has landed;
  4. slots of ops that are done and whose pages were consumed go back
     (`append_host_mem_release`);
  5. `run_batch` + `process_batch_result`: if the charged batch has ended,
     finish it (first tokens, decode tokens, write-back of newly full pages
     through `backup`, SGLang's `write_backup_storage`); if the "GPU" is idle,
     start the next batch, a chunked prefill of ready requests (FIFO,
     `chunk_tokens` budget; a request whose KV is still on its way to the
     device is skipped) before a decode step of running requests; with
     nothing to run, `on_idle` and round again;
  6. with `yield_ms`, sleep (the user's `time.sleep(0.001)` workaround);
     otherwise go round at once.
The loop never blocks and never sleeps while work is pending: like SGLang's,
it spins through these checks while requests wait for their prefetch, so it
holds the GIL except when CPython's switch interval (5 ms) forces it to hand
over. An in-process reader thread gets the GIL only then, and loses it again
whenever it releases it for a system call while this thread is on a CPU to
take it: that is the starvation the `file` and `fast_file` runs show. It
needs the scheduler thread to have a CPU of its own, as it has on a serving
host; on a machine whose CPUs are all busy (load above the CPU count) the
woken scheduler thread comes late, the reader keeps the GIL through its
system calls, and the baselines look faster than they are in production
(`bench` warns about such a run). The loop's own bookkeeping is its per-step
work; it is not padded to SGLang's heavier step (tens of microseconds of
batch building): a longer step holds the GIL no more and no less, as long as
it does not release it, and only slows the loop's reaction. So it is not
the stand-in busy loop of `hicache_mp.bench.loop` (a fixed step of
bookkeeping beside a poll): its steps are this model's own bookkeeping.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .batches import INF, Batch, Batches, fifo_order
from .gputime import GpuTime
from .records import OpRecord, RunResult, op_record  # noqa: F401 (OpRecord, RunResult: API)
from .slots import HostSlots
from .summary import RequestResult
from .ttftparts import request_parts
from .workload import ComputeModel, Request


@dataclass
class SchedulerConfig:
    page_size: int = 64
    compute: ComputeModel = field(default_factory=ComputeModel)
    max_in_flight: int = 24
    arrival_scale: float = 1.0       # quick runs compress the release schedule too
    policy: str = "wait_complete"
    timeout_s: float = 10.0          # for the timeout policy
    yield_ms: float = 0.0
    idle_sleep0: bool = False        # SGLang 0.5.23's on_idle time.sleep(0) while requests wait
    host_slots: int = 0              # 0: the engine's pool size
    key_salt: str = ""               # salts write-back keys, so runs never hit each other's pages
    verify: bool = True              # check the first prefetched page of each request
    page_bytes_gen: object = None    # PageBytes: stamps write-back slots, checks prefetched ones
    progress: Callable | None = None  # progress(done, total, elapsed_s)
    progress_every: int = 8
    # Also report this often while no request finishes: a starved `file` run at
    # full scale goes minutes without one, and a silent run looks hung.
    progress_interval_s: float = 15.0
    max_run_s: float | None = None   # a stuck run raises instead of spinning for ever
    loader: object = None            # a DeviceLoader attached to the engine: pages go to the GPU
    direct: object = None            # direct.DirectLoads: SGLang's direct L3 path (mp-direct);
                                     # the engine then only writes back


class _Req:
    __slots__ = ("r", "keys", "wb_keys", "admit_s", "op", "slots", "hit_pages", "done_tokens",
                 "token_s", "seen_ns", "dev", "h2d", "marks", "prefill_s", "load", "wait_s")

    def __init__(self, r: Request, page_size: int, salt: str, admit_s: float):
        self.r = r
        self.keys = r.page_keys(page_size)
        self.wb_keys = [salt + k for k in r.computed_page_keys(page_size)]
        self.admit_s = admit_s
        self.op = None
        self.slots = None
        self.hit_pages = 0
        self.done_tokens = 0         # prompt tokens whose KV exists (hit + prefilled)
        self.token_s: list[float] = []
        self.seen_ns = 0
        self.dev = None              # device pages holding this request's prefetched KV
        self.h2d = None              # its DeviceLoader handle
        # Its TTFT milestones (ttftparts.MILESTONES, s from the run's start) and
        # the charged time of the prefill batches that carried it.
        self.marks = {"admit": admit_s}
        self.prefill_s = 0.0
        self.load = None             # mp-direct: its DirectLoads load, from its first chunk
        self.wait_s = 0.0            # mp-direct: its batches' waits for layers still loading


class Scheduler(Batches):
    def __init__(self, name: str, engine, requests: list[Request], config: SchedulerConfig):
        self.name = name
        self.engine = engine
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.rid))
        self.cfg = config
        pool = getattr(engine, "host_pool", None)
        self.pool = pool
        self.slots = HostSlots(config.host_slots or (pool.num_pages if pool else 1 << 16))
        self.loader = config.loader if pool is not None else None
        self.dev_slots = HostSlots(self.loader.num_device_pages) if self.loader else None
        self.h2d_seen: dict[int, int] = {}   # op id -> when its pages were seen on the device
        self.h2d_pending: list[_Req] = []    # prefetch settled, pages still on the way
        self.direct = config.direct

    # --- the loop -------------------------------------------------------------
    def run(self) -> RunResult:
        cfg, eng, ps = self.cfg, self.engine, self.cfg.page_size
        pending = deque(self.requests)
        lookup: deque[_Req] = deque()
        self.prefetching: list[_Req] = []
        self.ready: list[_Req] = []      # prefetch settled, prompt not fully prefilled (FIFO)
        self.running: list[_Req] = []    # decoding
        self.finished: list[_Req] = []
        self.consumed: list[tuple] = []  # (op, slots, rid, seen_ns): slots back once op is done
        self.backups: list[tuple] = []   # (rid, op, slots)
        self.done_prefetch: list[tuple] = []
        self.done_backup: list[tuple] = []
        self.batches: list[tuple] = []
        self.verified, self.verify_failures, self.backup_skipped = 0, [], 0
        self._device_wait = False        # _next_batch skipped a request whose KV is still loading
        gpu = GpuTime()
        total = len(self.requests)
        batch: Batch | None = None
        yield_s = cfg.yield_ms / 1000.0
        iters = reported = 0
        t0 = self.t0_ns = time.perf_counter_ns()
        now_s = last_report_s = 0.0
        while len(self.finished) < total:
            iters += 1
            now_ns = time.perf_counter_ns()
            now_s = (now_ns - t0) / 1e9
            if cfg.max_run_s and now_s > cfg.max_run_s:
                raise RuntimeError(f"{self.name}: run exceeded {cfg.max_run_s:.0f} s with "
                                   f"{len(self.finished)}/{total} requests done")
            # 1. ingest_requests
            in_system = total - len(pending) - len(self.finished)
            while pending and in_system < cfg.max_in_flight and \
                    pending[0].arrival_s * cfg.arrival_scale <= now_s:
                lookup.append(_Req(pending.popleft(), ps, cfg.key_salt, now_s))
                in_system += 1
            # 2. _prefetch_kvcache: lookup and prefetch start; FIFO, so a request
            # short of slots holds the line
            while lookup:
                q = lookup[0]
                if self.direct is not None:
                    # No host tier: the hit is loaded when its first chunk runs.
                    self._ready_direct(lookup.popleft(), now_s)
                    continue
                hit = eng.exists(q.keys + q.wb_keys)
                slots = self.slots.alloc(hit) if hit else []
                if slots is None:
                    break
                dev = self.dev_slots.alloc(hit) if hit and self.loader else None
                if hit and self.loader and dev is None:
                    self.slots.release(slots)
                    break
                lookup.popleft()
                q.slots = slots
                q.marks["submit"] = now_s
                if hit:
                    q.op = eng.prefetch(q.keys[:hit], slots, policy=cfg.policy,
                                        timeout_s=cfg.timeout_s)
                    if dev is not None:
                        # Copies start as pages land (the loader's poll() below).
                        q.dev, q.h2d = dev, self.loader.load(q.op, dev)
                    self.prefetching.append(q)
                else:
                    self.ready.append(q)
            # 3. check_hicache_events, then check_prefetch_progress per waiting request
            (self.loader or eng).poll()   # a loader polls the engine, then steps
            if self.direct is not None:
                self.direct.poll(now_s)
            if self.prefetching:
                self._check_prefetches(now_ns)
            if self.h2d_pending:
                self._check_h2d()
            # 4. host memory of consumed prefetches and finished backups back
            if self.consumed:
                self._retire_prefetches()
            if self.backups:
                self._retire_backups()
            # 5. run_batch / process_batch_result; on_idle when nothing runs
            if batch is not None and batch.loads and batch.end_s == INF:
                end = self.direct.end_s(batch.start_s, batch.charged_s, batch.loads)
                if end is not None:   # every group of its loads seen on the device
                    batch.end_s = end
            if batch is not None and now_s >= batch.end_s:
                self._finish(batch, now_s)
                gpu.finished(batch, now_s)
                n = len(self.finished)
                if cfg.progress and batch.finished_some and (
                        n // cfg.progress_every > reported // cfg.progress_every or n == total):
                    reported, last_report_s = n, now_s
                    cfg.progress(n, total, now_s)
                batch = None
            elif cfg.progress and cfg.progress_interval_s and \
                    now_s - last_report_s >= cfg.progress_interval_s:
                last_report_s = now_s
                cfg.progress(len(self.finished), total, now_s)
            if batch is None:
                batch = self._next_batch(now_s, now_ns)
                if batch is not None:
                    gpu.started(now_s)
                else:
                    gpu.idle(now_s, "device" if self._device_wait else "prefetch"
                             if self.prefetching else "slots" if lookup else "arrival")
                    if cfg.idle_sleep0 and self.prefetching:
                        # on_idle of SGLang 0.5.23: not fully idle, storage on ->
                        # time.sleep(0), "storage workers need the GIL between I/O calls".
                        time.sleep(0)
            # 6. the user's workaround (not SGLang's)
            if yield_s:
                time.sleep(yield_s)
        duration_s = now_s
        # Write-backs (and cancelled reads) still in flight are not part of the
        # measured run, but their slots and rates are: let them land.
        for rid, op, slots in self.backups:
            if not op.done:
                eng.wait(op, 60.0)
            self.slots.release(slots)
            self.done_backup.append((rid, op, 0))
        for op, slots, rid, seen in self.consumed:
            if not op.done:
                eng.wait(op, 60.0)
            if getattr(op, "device_event", None) is not None:
                op.device_event.wait(60.0)
            self.slots.release(slots)
            self.done_prefetch.append((rid, op, seen))
        metrics = eng.metrics()
        if self.direct is not None:  # the reads are the reader's; the write-backs eng's
            metrics = {**self.direct.reader.metrics(), "writer": metrics}
        finished = sorted(self.finished, key=lambda q: q.r.rid)
        return RunResult(
            name=self.name, backend=getattr(eng, "backend", "?"), policy=cfg.policy,
            yield_ms=cfg.yield_ms, t0_ns=t0, duration_s=duration_s, loop_iters=iters,
            requests=[self._result(q) for q in finished],
            hit_tokens=[q.hit_pages * ps for q in finished],
            prefetch=sorted((op_record(rid, op, seen, self.h2d_seen.get(getattr(op, "id", None), 0))
                             for rid, op, seen in self.done_prefetch),
                            key=lambda o: o.submit_ns),
            backups=sorted((op_record(rid, op, seen) for rid, op, seen in self.done_backup),
                           key=lambda o: o.submit_ns),
            batches=self.batches, verified_pages=self.verified,
            verify_failures=self.verify_failures, backup_skipped_pages=self.backup_skipped,
            slots_low_water=self.slots.low_water, engine_metrics=metrics, gpu=gpu.to_dict())

    # --- steps ----------------------------------------------------------------
    def _ready_direct(self, q: _Req, now_s: float) -> None:
        """mp-direct's lookup: the hit counts at once (SGLang's tree takes the
        linker's lookup), and the request is ready; its load starts with its
        first chunk (`Batches._next_batch`)."""
        hit = self.direct.reader.exists(q.keys + q.wb_keys)
        q.hit_pages = hit
        q.done_tokens = hit * self.cfg.page_size
        q.slots = []
        q.marks["submit"] = now_s
        self.ready.append(q)

    def _direct_landed(self, load, now_ns: int) -> None:
        """A finished batch's load: every group read and on the device. Its first
        page is checked, group by group, in the host slots it landed in."""
        if self.cfg.verify and self.pool is not None:
            gen, d = self.cfg.page_bytes_gen, self.direct
            if not load.failed and all(
                    gen.matches_part(d.reader.host_pool, d.slots_of(load, g)[0], load.keys[0],
                                     g, d.groups) for g in range(d.groups)):
                self.verified += 1
            else:
                self.verify_failures.append(load.rid)
        self.direct.release_slots(load)
        for op in load.ops:
            self.done_prefetch.append((load.rid, op, now_ns))

    def _check_prefetches(self, now_ns: int) -> None:
        timeout = self.cfg.policy == "timeout"
        # Most iterations settle nothing (pages are still on their way): one
        # pass that builds no list then.
        for q in self.prefetching:
            if q.op.done or (timeout and q.op.ready(now_ns)):
                break
        else:
            return
        still = []
        for q in self.prefetching:
            op = q.op
            if op.done or (timeout and op.ready(now_ns)):
                self._settle(q, now_ns)
                self.ready.append(q)
            else:
                still.append(q)
        if len(still) != len(self.prefetching):
            self.prefetching = still
            self.ready.sort(key=fifo_order)

    def _check_h2d(self) -> None:
        still = []
        for q in self.h2d_pending:
            if q.h2d.done:
                # A fresh clock: this loop's poll() may have finished the op and its copies.
                seen = self.h2d_seen[q.h2d.op.id] = time.perf_counter_ns()
                q.marks["on_device"] = (seen - self.t0_ns) / 1e9
            else:
                still.append(q)
        self.h2d_pending = still

    def _settle(self, q: _Req, now_ns: int) -> None:
        """The prefetch is over for the scheduler: fix the hit and check a page."""
        op = q.op
        if not op.done:
            self.engine.cancel(op)   # completed_pages freezes here
        q.hit_pages = op.completed_pages
        q.done_tokens = q.hit_pages * self.cfg.page_size
        q.seen_ns = now_ns
        t0 = self.t0_ns
        # A cut-short prefetch's read ended, for its request, when it was cut.
        q.marks.update(submit=(op.submit_ns - t0) / 1e9,
                       first_page=(op.first_ns - t0) / 1e9 if op.first_ns else None,
                       landed=((op.done_ns or now_ns) - t0) / 1e9, seen=(now_ns - t0) / 1e9)
        if q.h2d is not None:
            self.h2d_pending.append(q)
        if self.cfg.verify and self.pool is not None and q.hit_pages:
            if self.cfg.page_bytes_gen.matches(self.pool, q.slots[0], q.keys[0]):
                self.verified += 1
            else:
                self.verify_failures.append(q.r.rid)

    def _retire_prefetches(self) -> None:
        keep = []
        for item in self.consumed:
            op, slots, rid, seen = item
            h2d = getattr(op, "device_event", None)
            if op.done and (h2d is None or h2d.done):  # the loader may still read the slots
                self.slots.release(slots)
                self.done_prefetch.append((rid, op, seen))
            else:
                keep.append(item)
        self.consumed = keep

    def _retire_backups(self) -> None:
        for item in self.backups:
            if item[1].done:
                break
        else:
            return  # none done: most iterations
        keep = []
        for item in self.backups:
            rid, op, slots = item
            if op.done:
                self.slots.release(slots)
                self.done_backup.append((rid, op, 0))
            else:
                keep.append(item)
        self.backups = keep

    def _result(self, q: _Req) -> RequestResult:
        ts = q.token_s
        return RequestResult(rid=q.r.rid, prompt_len=q.r.prompt_len, output_len=q.r.output_len,
                             cached_len=q.hit_pages * self.cfg.page_size,
                             ttft_s=ts[0] - q.admit_s,
                             itl_s=[b - a for a, b in zip(ts, ts[1:])],
                             latency_s=ts[-1] - q.admit_s,
                             ttft_parts=request_parts({**q.marks, "first_token": ts[0]},
                                                      q.prefill_s, q.wait_s))
