"""bench_vllm_tier: vLLM's own `fs` tier against hicache_mp's, through vLLM's classes, in one run.

Both tiers are built by vLLM's SecondaryTierFactory over one real CPU tier
(vLLM's SharedOffloadRegion: the mmap of /dev/shm/vllm_offload_<id>.mmap) and
driven the way vLLM's scheduler drives them: TransferJob in, get_finished_jobs
polled once per scheduler step, lookups one key at a time with
on_schedule_end between steps. For every tier row, and for an idle scheduler
loop (it sleeps between steps) and a busy one (it spins on pure-Python
bookkeeping, calling nothing that gives the GIL up, as a loaded scheduler
does), with warm (buffered, page cache) and cold (O_DIRECT, where the
filesystem takes it) I/O: store GB/s, load GB/s, the loop's iteration rate
while loading relative to its rate with no I/O, and every loaded byte checked.
Then the latency to resolve 2,000 lookups of pages another instance wrote.
Ratios ours / fs are from this same run.

Tier rows: `hicache_mp` (this engine), `fs C(<how>)` (vLLM's tier with its C
helper vllm/fs_io_C: the wheel's where it loads, else one built from vLLM's
sdist with --build-fs-helper, or given with --fs-helper), `fs Python` (its
os.readv/os.write fallback), each fs row at every thread count of
--fs-threads. The wheel's helper links CUDA and torch 2.14 although its source
(csrc/fs_io.cpp) uses only Python.h; --build-fs-helper compiles that one file
with the limited API of Python 3.11, so the .so also loads on 3.12.

    python scripts/bench_vllm_tier.py --quick                      # CPU smoke run
    python scripts/bench_vllm_tier.py --calls --rows 1024 --job-rows 32   # µs per call
    python scripts/bench_vllm_tier.py --rows 2048 --store /nvme/b --json out.json \
        --fs-helper build/fs_io_C.abi3.so --fs-threads 4,16,32,64
"""
import argparse
import contextlib
import glob
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import uuid

import numpy as np

from hicache_mp.bench.floor import PacedReaders
from hicache_mp.bench.giltrace import released_in
from hicache_mp.bench.loop import STEP_SPIN_S, spin_for, spin_rate
from workers.pagefile import HEADER_SIZE

ROW_8B = 32 * 2 * 8 * 128 * 2 * 16  # Llama-3.1-8B, one 16-token block: 2 MiB
IDLE_SLEEP_S = 0.0005


def load_fs_helper(path: str | None) -> str | None:
    """Make `vllm.fs_io_C` importable before vLLM's fs tier is; how, or None."""
    try:
        import vllm.fs_io_C  # noqa: F401
        return "wheel"
    except ImportError as exc:
        why = str(exc)
    if path:
        spec = importlib.util.spec_from_file_location("vllm.fs_io_C", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["vllm.fs_io_C"] = mod
        return f"built: {os.path.basename(path)}"
    print(f"vLLM's C helper does not load ({why}); fs rows are Python only "
          f"(--build-fs-helper SDIST builds it)")
    return None


def build_fs_helper(sdist: str, out: str) -> str:
    """Compile vLLM's csrc/fs_io.cpp from its sdist (a .tar.gz or an unpacked tree)."""
    src = os.path.join(sdist, "csrc", "fs_io.cpp")
    tmp = None
    if os.path.isfile(sdist):
        tmp = tempfile.mkdtemp()
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/csrc/fs_io.cpp"))
            tar.extract(member, tmp, filter="data")
            src = os.path.join(tmp, member.name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    cmd = ["g++", "-O2", "-shared", "-fPIC", "-std=c++17", "-DPy_LIMITED_API=0x030B0000",
           f"-I{sysconfig.get_paths()['include']}", src, "-o", out]
    subprocess.run(cmd, check=True)
    if tmp:
        shutil.rmtree(tmp)
    print(f"built {out} from {sdist}")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512, help="rows moved per phase")
    p.add_argument("--row-bytes", type=int, default=ROW_8B, help="bytes per CPU-tier row "
                   "(default: one 16-token block of Llama-3.1-8B, 2 MiB)")
    p.add_argument("--job-rows", type=int, default=32, help="rows per TransferJob")
    p.add_argument("--store", default=None, help="directory for the stores (default: a "
                   "temporary one under /tmp); each row gets its own subdirectory")
    p.add_argument("--workers", type=int, default=0, help="hicache_mp workers (0: auto)")
    p.add_argument("--fs-threads", default="4,16,32", help="fs read and write threads, swept")
    p.add_argument("--fs-py-threads", default=None, help="the same for the Python fallback "
                   "(default: --fs-threads; 0: no Python fallback row, for runs that "
                   "time this engine alone, as a before/after comparison does)")
    p.add_argument("--fs-helper", default=None, help="a built vllm/fs_io_C .so to load")
    p.add_argument("--build-fs-helper", metavar="SDIST", default=None,
                   help="build the helper from vLLM's sdist (.tar.gz or unpacked) first")
    p.add_argument("--helper-out", default="build/fs_io_C.abi3.so")
    p.add_argument("--io", default="warm,cold", help="warm (buffered) and/or cold (O_DIRECT)")
    p.add_argument("--modes", default="idle,busy")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every tier row, "
                   "interleaved (round 1 of each row, then round 2, ...); the table shows "
                   "each figure's median over them, the JSON every round")
    p.add_argument("--lookup-keys", type=int, default=2000)
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the loop's floor after each busy warm hicache_mp load: the same "
                        "spin beside plain reader processes that copy the same page files at "
                        "the load's rate, no engine (hicache_mp.bench.floor)")
    p.add_argument("--phase-timeout-s", type=float, default=120.0)
    p.add_argument("--quick", action="store_true", help="small sizes: a CPU smoke run")
    p.add_argument("--calls", action="store_true", help="only the per-call costs on the "
                   "scheduler's thread (µs per call, GIL releases), each tier at its largest "
                   "thread count")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.row_bytes, args.job_rows = 16, 64 << 10, 4
        args.fs_threads, args.lookup_keys, args.workers = "2", 200, args.workers or 2
    args.fs_threads = [int(x) for x in args.fs_threads.split(",")]
    args.fs_py_threads = [t for t in (int(x) for x in (args.fs_py_threads.split(",")
                                                       if args.fs_py_threads
                                                       else args.fs_threads)) if t > 0]
    return args


# --- vLLM's side ------------------------------------------------------------------
def offloading_config(engine_id: str, row_bytes: int, rows: int, tiers: list,
                      model: str = "test/model", **extra):
    """A real OffloadingConfig for one worker whose CPU tier holds `rows` rows."""
    from vllm.v1.kv_offload.config import OffloadingCacheConfig, OffloadingConfig, \
        OffloadingGroupConfig, OffloadingModelConfig, OffloadingParallelConfig
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",),
                                      group_id=0),),
        worker_kv_bytes_per_block=row_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": row_bytes * rows, "secondary_tiers": tiers, **extra},
        engine_id=engine_id, model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False))


class Rig:
    """One CPU tier (vLLM's, via its spec) and tiers built over it by vLLM's factory."""

    def __init__(self, row_bytes: int, rows: int):
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
        self.engine_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.spec = TieringOffloadingSpec(offloading_config(self.engine_id, row_bytes, rows, []))
        self.manager = self.spec.get_manager()
        self.kv = self.manager.primary_tier.get_kv_memoryview()
        self.view = np.asarray(self.kv).view(np.uint8)
        # vLLM unlinks its region's file only at shutdown (or after a barrier its
        # workers pass, which this one-process rig has none of): a run killed by a
        # timeout left 8 GiB files in /dev/shm. Mapped, they need no name; vLLM's
        # own unlink ignores a file already gone.
        for path in glob.glob(f"/dev/shm/vllm_offload_{self.engine_id}.mmap*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def tier(self, kind: str, store: str, *, threads: int = 0, direct: bool = False,
             workers: int = 0):
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        if kind == "hicache_mp":
            cfg = {"type": "HiCacheMPTier", "module_path": "hicache_mp.integrations.vllm",
                   "storage_dir": store, "num_workers": workers,
                   "direct_io": "on" if direct else "off"}
        else:
            cfg = {"type": "fs", "root_dir": store, "n_read_threads": threads,
                   "n_write_threads": threads}
        tier = SecondaryTierFactory.create_secondary_tier(cfg, self.kv, self.spec)
        if kind != "hicache_mp":
            if direct and not tier._use_o_direct:
                tier.shutdown()
                raise OSError("O_DIRECT refused by the store's filesystem")
            tier._use_o_direct = direct  # warm rows: buffered, as ours
        return tier

    def close(self):
        self.view = None
        self.manager.shutdown()


def set_fs_c(on: bool) -> None:
    """vLLM's fs tier reads these flags at each call: C helper or Python fallback."""
    from vllm.v1.kv_offload.tiering.fs import io, manager
    io._HAS_FSIO_C = on
    manager._HAS_BATCH_LOOKUP_C = on


# --- the scheduler loop -------------------------------------------------------------
class Clock:
    """Seconds the scheduler's thread spent inside the tier's calls, and spinning."""

    def __init__(self):
        self.calls_s, self.spin_s, self.calls = 0.0, 0.0, 0

    def call(self, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.calls_s += time.perf_counter() - t
            self.calls += 1


def steps(tier, busy: bool, until, timeout_s: float, on_result=None, before=None,
          clock: Clock | None = None):
    """Run scheduler steps until `until()`; (wall seconds, loop iterations, capped).
    Every tier gets the same step: its work, then one get_finished_jobs and one
    on_schedule_end; `clock` sums the time inside those calls and the spinning."""
    from vllm.v1.kv_offload.base import ScheduleEndContext
    step_ctx = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    clock = clock if clock is not None else Clock()
    book, iters = {}, 0
    t0 = time.perf_counter()
    while True:
        # A step: the scheduler's own work first (spin or sleep), then the tier's calls.
        if busy:
            t = time.perf_counter()
            iters += spin_for(STEP_SPIN_S, book)
            clock.spin_s += time.perf_counter() - t
        else:
            time.sleep(IDLE_SLEEP_S)
        if before is not None:
            before()
        for result in clock.call(tier.get_finished_jobs):
            if on_result is not None:
                on_result(result)
        clock.call(tier.on_schedule_end, step_ctx)
        if until():
            return time.perf_counter() - t0, iters, False
        if time.perf_counter() - t0 > timeout_s:
            return time.perf_counter() - t0, iters, True


# --- one tier row --------------------------------------------------------------------
def move(tier, rig, args, keys, src, dst, busy: bool, load: bool, first_id: int):
    """Submit every job of one phase at once, step until all report; a dict."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob
    jobs, ctx = {}, ReqContext(req_id="bench")
    rows = dst if load else src
    for i, j in enumerate(range(0, len(keys), args.job_rows)):
        jobs[first_id + i] = (j, min(j + args.job_rows, len(keys)))
    done, ok_rows = {}, []

    def on_result(r):
        if r.job_id in jobs:
            done[r.job_id] = r
            lo, hi = jobs[r.job_id]
            if r.success:
                ok_rows.extend(range(lo, hi))
            elif r.successful_keys:
                good = set(r.successful_keys)
                ok_rows.extend(i for i in range(lo, hi) if keys[i] in good)

    submit = tier.submit_load if load else tier.submit_store
    tjs = [TransferJob(job_id=job_id, keys=keys[lo:hi], chunk_ids=np.asarray(rows[lo:hi]),
                       is_promotion=load, req_context=ctx) for job_id, (lo, hi) in jobs.items()]
    clock = Clock()
    t0 = time.perf_counter()
    for tj in tjs:
        clock.call(submit, tj)
    submit_s = clock.calls_s
    wall, iters, capped = steps(tier, busy, lambda: len(done) == len(jobs),
                                args.phase_timeout_s, on_result, clock=clock)
    wall = max(wall, time.perf_counter() - t0)
    # Where the scheduler thread's phase went: inside the tier's calls (submits
    # included), spinning, and the spin's own rate (iterations per spinning second).
    out = {"gbps": len(ok_rows) * args.row_bytes / wall / 1e9, "seconds": wall,
           "rows_ok": len(ok_rows), "loop_iters": iters, "capped": capped,
           "tier_calls_s": clock.calls_s, "submit_s": submit_s, "tier_calls": clock.calls,
           "call_share": clock.calls_s / wall, "spin_s": clock.spin_s,
           "spin_rate": iters / clock.spin_s if clock.spin_s else 0.0}
    if load:
        ok = np.asarray(sorted(ok_rows), dtype=np.int64)
        got, want = rig.view[np.asarray(dst)[ok]], rig.view[np.asarray(src)[ok]]
        out["bytes_verified"] = int(got.size)
        out["wrong_bytes"] = int(np.count_nonzero(got != want))
    return out


def tier_row(rig, args, kind, label, store, *, threads, direct, busy, run_id, baseline_s):
    """One tier at one setting: store, then load, then the bytes checked;
    `baseline_s` of loop with no I/O are measured just before the load (busy)."""
    from vllm.v1.kv_offload.base import make_offload_key
    n = args.rows
    src, dst = list(range(n)), list(range(n, 2 * n))
    keys = [make_offload_key((run_id << 32 | i).to_bytes(8, "big"), 0) for i in range(n)]
    row = {"tier": label, "threads": threads, "mode": "busy" if busy else "idle",
           "io": "cold" if direct else "warm"}
    try:
        tier = rig.tier(kind, store, threads=threads, direct=direct, workers=args.workers)
    except (OSError, ValueError) as exc:
        row["error"] = str(exc)
        return row
    try:
        if kind == "hicache_mp":
            row["threads"] = tier.engine.worker_count()
        row["store"] = move(tier, rig, args, keys, src, dst, busy, False, 1)
        rig.view[n:2 * n] = 0
        if busy:  # the loop's rate with no I/O, just before and after: the machine drifts
            before = spin_rate(baseline_s)
        row["load"] = move(tier, rig, args, keys, src, dst, busy, True, 1 << 20)
        if busy:
            after = spin_rate(baseline_s)
            row["loop_rate_no_io"] = rate = (before + after) / 2
            row["loop_rate_no_io_before_after"] = [before, after]
            ld = row["load"]
            row["loop_ratio"] = ld["loop_iters"] / ld["seconds"] / rate
            # loop_ratio = spin_ratio x spin share of the phase: the tier's calls
            # take the rest of the thread, a slower spin is the machine (cores,
            # memory) or the GIL given to another thread of this process
            row["spin_ratio"] = ld["spin_rate"] / rate
            if kind == "hicache_mp" and not direct and args.floor:
                row["floor"] = floor_phase(store, args.row_bytes, row["threads"], ld["seconds"])
                row["floor"]["loop_ratio"] = row["floor"]["loop_rate"] / rate
                # The tier's own cost to the loop: the floor moved the same bytes
                # at the same rate with no engine (hicache_mp.bench.floor).
                row["loop_over_floor"] = ld["loop_iters"] / ld["seconds"] / row["floor"]["loop_rate"]
    finally:
        tier.drain_jobs()
        tier.shutdown()
        shutil.rmtree(store, ignore_errors=True)
    return row


def floor_phase(store: str, row_bytes: int, readers: int, seconds: float) -> dict:
    """The busy loop's spin, as `steps` runs it less the tier's calls, for
    `seconds` beside `readers` plain processes that copy this tier's page files
    (the rows the load just read) in that time: the machine's own share."""
    items = [(os.path.join(d, f), HEADER_SIZE, row_bytes) for d, _, files in os.walk(store)
             for f in files if f.endswith(".page")
             and os.path.getsize(os.path.join(d, f)) == HEADER_SIZE + row_bytes]
    if not items:
        return {"error": "no page files of this row's size in the store"}
    book, iters = {}, 0
    with PacedReaders(items, readers) as floor:
        start = floor.start(seconds)
        while time.monotonic() < start:
            pass
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            iters += spin_for(STEP_SPIN_S, book)
        elapsed = time.perf_counter() - t0
        moved = floor.finish()
    return {"loop_rate": iters / elapsed, "seconds": elapsed, "readers": moved["workers"],
            "readers_gbps": moved["gbps"], "rows": len(items)}


def lookup_row(args, kind, label, store, busy: bool, threads: int):
    """Pages written by one instance, asked of another: steps until all 2,000 resolve."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    n = args.lookup_keys
    rig = Rig(4096, n)
    reader = rig.tier(kind, store, threads=threads, workers=args.workers)
    writer = rig.tier(kind, store, threads=threads, workers=args.workers)
    keys = [make_offload_key((7 << 40 | i).to_bytes(8, "big"), 0) for i in range(n)]
    try:
        writer.submit_store(TransferJob(job_id=1, keys=keys, chunk_ids=np.arange(n),
                                        is_promotion=False, req_context=ReqContext("w")))
        # the store is written when its job is reported: the same public signal
        # from both tiers (vLLM's get_finished_jobs), no count read from inside
        stored = set()
        steps(writer, False, lambda: 1 in stored, args.phase_timeout_s,
              on_result=lambda result: stored.add(result.job_id))
        ctx, state, calls = ReqContext(req_id="r"), {"left": n, "hits": 0}, [0.0]

        def ask():
            t = time.perf_counter()
            answers = [reader.lookup(k, ctx) for k in keys]
            calls[0] += time.perf_counter() - t
            state["left"] = sum(a is LookupResult.RETRY for a in answers)
            state["hits"] = sum(a is LookupResult.HIT for a in answers)

        wall, _, capped = steps(reader, busy, lambda: state["left"] == 0, args.phase_timeout_s,
                                before=ask)
        return {"tier": label, "threads": threads, "mode": "busy" if busy else "idle",
                "keys": n, "resolve_ms": wall * 1e3, "lookup_calls_ms": calls[0] * 1e3,
                "hits": state["hits"], "capped": capped}
    finally:
        for t in (reader, writer):
            t.drain_jobs()
            t.shutdown()
        rig.close()
        shutil.rmtree(store, ignore_errors=True)


def per_call_us(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def calls_row(args, kind, label, store, threads: int):
    """µs per scheduler-thread call, idle scheduler (the tier's own cost, not the
    loop's): get_finished_jobs with nothing in flight, submit per job, the
    get_finished_jobs calls that found nothing while jobs were in flight, those
    that returned jobs (per job), a lookup that hits; and, for each, the C calls
    that let the GIL go (giltrace.released_in)."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob
    n, per = args.rows, args.job_rows
    rig = Rig(args.row_bytes, 2 * n)
    tier = rig.tier(kind, store, threads=threads, workers=args.workers)
    keys = [make_offload_key((9 << 40 | i).to_bytes(8, "big"), 0) for i in range(n)]
    ctx = ReqContext(req_id="c")
    out = {"tier": label, "threads": threads, "job_rows": per, "jobs": -(-n // per)}
    gil = {}

    def traced(name, fn):
        res, found = released_in(fn)
        gil[name] = sorted({f"{site} {what}" for site, what in found})
        return res

    def phase(load: bool, base: int, trace: bool):
        """Submit a phase's jobs, poll until all report: (µs per submit, median µs of
        the polls that found nothing, µs per job reported). Traced: GIL only."""
        tjs = [TransferJob(job_id=base + j, keys=keys[j:j + per],
                           chunk_ids=np.arange(j, min(j + per, n)) + (n if load else 0),
                           is_promotion=load, req_context=ctx) for j in range(0, n, per)]
        submit = tier.submit_load if load else tier.submit_store
        t = time.perf_counter()
        if trace:
            traced("submit_load" if load else "submit_store", lambda: [submit(tj) for tj in tjs])
        else:
            for tj in tjs:
                submit(tj)
        sub = (time.perf_counter() - t) / len(tjs) * 1e6
        empty, full, got = [], 0.0, 0
        deadline = time.monotonic() + args.phase_timeout_s
        while got < len(tjs) and time.monotonic() < deadline:
            time.sleep(IDLE_SLEEP_S)
            t = time.perf_counter()
            res = list(tier.get_finished_jobs())
            dt = time.perf_counter() - t
            if res:
                full, got = full + dt, got + len(res)
            else:
                empty.append(dt)
        if trace:  # a poll that finds jobs done (the next phase's first jobs)
            return None
        return sub, (float(np.median(empty)) * 1e6 if empty else None), \
            (full / got * 1e6 if got else None)

    try:
        out["finished_idle_us"] = per_call_us(tier.get_finished_jobs, 20000)
        (out["submit_store_us_per_job"], out["finished_none_in_flight_us"],
         out["finished_us_per_job_store"]) = phase(False, 0, False)
        out["submit_load_us_per_job"], _, out["finished_us_per_job_load"] = \
            phase(True, 1 << 20, False)
        out["lookup_hit_us"] = per_call_us(lambda: tier.lookup(keys[0], ctx), 20000)
        # Traced apart: tracing costs far more than the calls.
        traced("get_finished_jobs idle", tier.get_finished_jobs)
        phase(False, 2 << 20, True)
        phase(True, 3 << 20, True)
        traced("lookup", lambda: [tier.lookup(k, ctx) for k in keys])
        tjs = [TransferJob(job_id=(4 << 20) + j, keys=keys[j:j + per],
                           chunk_ids=np.arange(j, min(j + per, n)) + n, is_promotion=True,
                           req_context=ctx) for j in range(0, n, per)]
        for tj in tjs:
            tier.submit_load(tj)
        time.sleep(0.5)
        traced("get_finished_jobs with jobs done", tier.get_finished_jobs)
        out["gil_released_in"] = gil
    finally:
        tier.drain_jobs()
        tier.shutdown()
        rig.close()
        shutil.rmtree(store, ignore_errors=True)
    return out


# --- report ------------------------------------------------------------------------------
def medians(rows):
    """One row per tier setting: each figure the median over its rounds (--repeats),
    bytes summed; a setting with an error in any round shows that error."""
    groups = {}
    for r in rows:
        groups.setdefault((r["tier"], r["threads"], r["mode"], r["io"]), []).append(r)
    out = []
    for key, rs in groups.items():
        if len(rs) == 1 or any("error" in r for r in rs):
            out.append(next((r for r in rs if "error" in r), rs[0]))
            continue
        med = lambda get: statistics.median(get(r) for r in rs)  # noqa: E731
        row = dict(rs[0], rounds=len(rs))
        row["store"] = dict(rs[0]["store"], gbps=med(lambda r: r["store"]["gbps"]),
                            capped=any(r["store"]["capped"] for r in rs))
        row["load"] = dict(rs[0]["load"], gbps=med(lambda r: r["load"]["gbps"]),
                           call_share=med(lambda r: r["load"]["call_share"]),
                           capped=any(r["load"]["capped"] for r in rs),
                           bytes_verified=sum(r["load"]["bytes_verified"] for r in rs),
                           wrong_bytes=sum(r["load"]["wrong_bytes"] for r in rs))
        for k in ("loop_ratio", "spin_ratio", "loop_over_floor"):
            if k in rs[0]:
                row[k] = med(lambda r: r[k])
                row[k + "_all"] = [r[k] for r in rs]
        if "floor" in rs[0] and "loop_ratio" in rs[0]["floor"]:
            row["floor"] = dict(rs[0]["floor"], loop_ratio=med(lambda r: r["floor"]["loop_ratio"]),
                                readers_gbps=med(lambda r: r["floor"]["readers_gbps"]))
        out.append(row)
    return out


def best(rows, tier_prefix, mode, io, what):
    vals = [(r[what]["gbps"], r["threads"]) for r in rows if r["tier"].startswith(tier_prefix)
            and r["mode"] == mode and r["io"] == io and what in r]
    return max(vals) if vals else (0.0, None)


def report(rows, looks, rate0, helper):
    n = max((r.get("rounds", 1) for r in rows), default=1)
    print(f"\n{f'medians of {n} interleaved rounds per row; ' if n > 1 else ''}"
          f"busy loop with no I/O: {rate0 / 1e6:.2f} M iterations/s; per load phase: loop = "
          f"the loop's rate / no I/O, calls = share of the phase inside the tier's calls "
          f"(submits included), spin = spinning rate / no I/O (loop ~ spin x (1 - calls))")
    print(f"{'tier':<22}{'thr':>5}{'mode':>6}{'io':>6}{'store GB/s':>12}{'load GB/s':>11}"
          f"{'loop':>7}{'calls':>7}{'spin':>6}{'verified':>12}{'wrong':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['tier']:<22}{r['threads']:>5}{r['mode']:>6}{r['io']:>6}  n/a: {r['error']}")
            continue
        s, ld = r["store"], r["load"]
        cap = "*" if s["capped"] or ld["capped"] else ""
        loop = f"{r['loop_ratio']:.2f}" if "loop_ratio" in r else "-"
        spin = f"{r['spin_ratio']:.2f}" if "spin_ratio" in r else "-"
        print(f"{r['tier']:<22}{r['threads']:>5}{r['mode']:>6}{r['io']:>6}{s['gbps']:>12.2f}"
              f"{ld['gbps']:>10.2f}{cap:1}{loop:>7}{ld['call_share']:>7.1%}{spin:>6}"
              f"{ld['bytes_verified']:>12}{ld['wrong_bytes']:>7}")
    for r in rows:
        fl = r.get("floor")
        if fl and "loop_ratio" in fl:
            spread = ", ".join(f"{x:.3f}" for x in r.get("loop_over_floor_all", [r["loop_over_floor"]]))
            print(f"  floor ({r['tier']}, {r['io']}): the loop beside {fl['readers']} plain readers "
                  f"copying the same rows at {fl['readers_gbps']:.2f} GB/s (the load: "
                  f"{r['load']['gbps']:.2f}) ran at {fl['loop_ratio']:.2f} of its rate with no I/O; "
                  f"loop beside the tier / beside the floor {r['loop_over_floor']:.3f} "
                  f"(target >= 0.97; rounds {spread})")
        elif fl:
            print(f"  floor ({r['tier']}): n/a, {fl['error']}")
    ratios = {}
    for mode in ("idle", "busy"):
        for io in ("warm", "cold"):
            ours = best(rows, "hicache_mp", mode, io, "load")[0]
            if not ours:
                continue
            for prefix in ("fs C", "fs Python"):
                for what in ("load", "store"):
                    theirs, thr = best(rows, prefix, mode, io, what)
                    mine = best(rows, "hicache_mp", mode, io, what)[0]
                    if theirs:
                        key = f"{what} {mode} {io}: hicache_mp / best {prefix} ({thr} threads)"
                        ratios[key] = mine / theirs
    for key, value in ratios.items():
        print(f"  {key}: {value:.2f}x")
    for r in looks:
        print(f"lookup {r['keys']} keys  {r['tier']:<14}{r['mode']:>5}: resolved in "
              f"{r['resolve_ms']:.1f} ms (lookup calls {r['lookup_calls_ms']:.1f} ms, "
              f"{r['hits']} hits){' capped' if r['capped'] else ''}")
    wrong = sum(r["load"]["wrong_bytes"] for r in rows if "load" in r)
    print(f"bytes verified: {sum(r['load']['bytes_verified'] for r in rows if 'load' in r)}, "
          f"wrong: {wrong}; fs C helper: {helper or 'none'}")
    return ratios


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.build_fs_helper:
        args.fs_helper = build_fs_helper(args.build_fs_helper, args.helper_out)
    helper = load_fs_helper(args.fs_helper)
    import hicache_mp.integrations.vllm  # noqa: F401  (pins the vLLM version)
    root = args.store or tempfile.mkdtemp(prefix="bench_vllm_tier.")
    os.makedirs(root, exist_ok=True)
    rig = Rig(args.row_bytes, 2 * args.rows)
    rig.view[:args.rows] = np.random.default_rng(0).integers(
        0, 256, (args.rows, args.row_bytes), dtype=np.uint8)
    rate0 = spin_rate(0.2 if args.quick else 1.0) if "busy" in args.modes else 0.0
    baseline_s = 0.2 if args.quick else 0.5
    plan = [("hicache_mp", "hicache_mp", None, [args.workers])]
    if helper:
        plan.append(("fs", f"fs C({helper.split(':')[0]})", True, args.fs_threads))
    if args.fs_py_threads:
        plan.append(("fs", "fs Python", False, args.fs_py_threads))
    rows, looks, run = [], [], 0
    if args.calls:
        rig.close()
        out = []
        for kind, label, c_on, counts in plan:
            if c_on is not None:
                set_fs_c(c_on)
            run += 1
            out.append(calls_row(args, kind, label, os.path.join(root, f"calls{run}"),
                                 max(counts)))
            print(json.dumps(out[-1]), flush=True)
        if args.store is None:
            shutil.rmtree(root, ignore_errors=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "fs_helper": helper, "calls": out}, f, indent=1)
        return 0
    try:
        for rep in range(args.repeats):
            for io in args.io.split(","):
                for mode in args.modes.split(","):
                    for kind, label, c_on, counts in plan:
                        for threads in counts:
                            if c_on is not None:
                                set_fs_c(c_on)
                            run += 1
                            rows.append(tier_row(rig, args, kind, label,
                                                 os.path.join(root, f"run{run}"),
                                                 threads=threads, direct=io == "cold",
                                                 busy=mode == "busy", run_id=run,
                                                 baseline_s=baseline_s))
                            rows[-1]["round"] = rep + 1
                            print(json.dumps(rows[-1]), flush=True)
        for mode in args.modes.split(","):
            for kind, label, c_on, counts in plan:
                if c_on is not None:
                    set_fs_c(c_on)
                run += 1
                looks.append(lookup_row(args, kind, label, os.path.join(root, f"look{run}"),
                                        mode == "busy", max(counts)))
    finally:
        rig.close()
        if args.store is None:
            shutil.rmtree(root, ignore_errors=True)
    ratios = report(medians(rows), looks, rate0, helper)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "fs_helper": helper,
                       "baseline_loop_rate": rate0, "rows": rows, "lookups": looks,
                       "ratios": ratios}, f, indent=1)
    return 1 if any(r.get("load", {}).get("wrong_bytes") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
