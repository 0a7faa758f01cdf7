"""Hybrid-model prefetch through SGLang 0.5.23's real HybridCacheController:
`mp` against the no-bytes floor, idle and under a busy scheduler, with the
GIL tracer.

Geometries (hicache_mp/bench/sglang/real_hybrid.py): `mamba` (Qwen3-Next: MHA KV +
one Mamba state per prefix), `swa` (gpt-oss: MHA KV + a sliding-window pool
of the last 2 pages) and `dsa` (DeepSeek-V3.2: MLA KV + the DSA indexer,
read with every KV page). Per geometry and backend one real
`HybridCacheController` over SGLang's real `HostPoolGroup`, its storage
threads and queues SGLang's, its backend built by SGLang's
StorageBackendFactory from the dynamic config: `mp` (hicache_mp's HiCacheMP)
or `nobytes` (hicache_mp/bench/sglang/nobytes.py: every call answered at once, no
bytes moved: SGLang's own side of a round). What is stood in (device side
only): hicache_mp/bench/sglang/hybrid_controller.py's docstring.

The main thread plays the scheduler (hicache_mp/bench/sglang/hybrid_rank.py: the
calls UnifiedRadixCache makes): a round is `--requests` concurrent
prefetches of `--round-pages` KV pages each, all submitted before any
wait, then the hit drain's host staging and the acks. Idle, the scheduler
blocks on SGLang's queues; busy, it runs pure Python that lets no GIL go
and polls the queues with get_nowait between chunks (scripts/sglang_stack.py's
`Scheduler`). The no-bytes run of the same mode follows each mp run; with
`--sleep-floor`, then the sleeping floor's (sglang_nobytes.Sleeping: no
bytes, one sleep per batch_get, GIL released, as long as mp's idle batch
took in that run: SGLang's hand-offs plus the one wait any backend makes).
Backups go through the controller too (`write_storage` with the pool
transfers the components build).

Figures per geometry and round size (medians of --runs, with the per-run
values): busy / idle GB/s, ms over idle per round, the backend's own cost
of a busy scheduler ((mp busy - mp idle) - (nobytes busy - nobytes idle))
per request, per batch_get call (all batch_get_v1 + batch_get_v2 calls
SGLang made) and per batch_get_v2 call, the busy loop's rate mp / floor,
SGLang's calls per request by name, and wrong pages (every KV and sidecar
page read is compared with the page written). Then `--trace-runs` traced
runs per mode (and one traced backup) give the tracer's per-call table.
Owns no engine logic.

    PYTHONPATH=. python3 scripts/sglang_hybrid_check.py --json $OUT/hybrid.json
    # small CPU run:
    PYTHONPATH=. python3 scripts/sglang_hybrid_check.py --tiny --round-pages 4,8 --runs 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from hicache_mp.bench.giltrace import GilTracer, NullTracer, table as trace_table
from hicache_mp.bench.sglang import hybrid_rank as HR
from hicache_mp.bench.sglang import real_hybrid as RH
from hicache_mp.bench.sglang.stack import Scheduler, backend_of, loop_rate_alone

GETS = ("batch_get_v1", "batch_get_v2")


def log(msg: str) -> None:
    print(f"[sglang_hybrid_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


TRACE = NullTracer()  # GilTracer() once main() installs it (--trace)


def one_run(rank, pages: int, busy: bool, label: str, timeout_s: float):
    """One prefetch round; (seconds, Scheduler). Raises on a short read."""
    sched = Scheduler(busy)
    with TRACE.round(label):
        dt, out = rank.prefetch(pages, sched, timeout_s)
    rank.finish(pages, out, label)
    return dt, sched


def median(xs):
    return statistics.median(xs) if xs else None


def controller_facts(rank) -> dict:
    """What the harness drove: SGLang's classes, as the controller holds them."""
    ctl = rank.ctl
    return {"controller": f"{type(ctl).__module__}.{type(ctl).__name__}",
            "host_pool_group": type(ctl.mem_pool_host).__name__,
            "pools": {e.name.value: type(e.host_pool).__name__ for e in ctl.mem_pool_host.entries},
            "anchor": ctl.mem_pool_host.anchor_entry.name.value,
            "device_pool": type(ctl.mem_pool_device).__name__,
            "backend": type(ctl.storage_backend).__name__,
            "is_mla_model": ctl.storage_config.is_mla_model,
            "page_get": ctl.page_get_func.__name__,
            "threads": [t.name for t in (ctl.prefetch_thread, ctl.prefetch_io_aux_thread,
                                         ctl.prefetch_sync_thread, ctl.backup_thread)
                        if t.is_alive()]}


def run_geometry(S, geom: str, args, root: str) -> dict:
    g = RH.geometry(geom, tiny=args.tiny)
    top = max(args.round_pages)
    ranks = {}
    try:
        for kind in ("mp", "nobytes") + (("sleeping",) if args.sleep_floor else ()):
            store = os.path.join(root, f"{geom}-{kind}")
            os.makedirs(store, exist_ok=True)
            ranks[kind] = HR.Rank(S, g, kind, store, requests=args.requests, max_pages=top,
                                  workers=args.workers)
        mp, nb, sl = ranks["mp"], ranks["nobytes"], ranks.get("sleeping")
        out = {"model": g["model"], "page_bytes": mp.page_bytes(),
               "sglang": controller_facts(mp), "sizes": {}}
        for pages in args.round_pages:
            out["sizes"][str(pages)] = run_size(mp, nb, geom, pages, args, sl)
        out["metrics"] = {k: v for k, v in mp.backend.metrics().items()
                          if k.startswith("sidecar")}
        return out
    finally:
        for r in ranks.values():
            r.close()


def _gets(rank) -> int:
    return sum(rank.calls.get(c, 0) for c in GETS)


def run_size(mp, nb, geom, pages, args, sl=None) -> dict:
    """`sl`: the sleeping floor (--sleep-floor): its run follows the no-bytes
    one, each of its batch_gets sleeping once for mp's idle batch of that run."""
    to = args.timeout_s
    everyone = (mp, nb) + ((sl,) if sl is not None else ())
    for r in everyone:
        t0 = time.perf_counter()
        if not r.backup(pages, Scheduler(False), to):
            raise AssertionError(f"{geom} {r.kind}: a backup of {pages} pages failed")
        if r is mp:
            write_s = time.perf_counter() - t0
    for r in everyone:   # warm: the first round pays the index and page cache
        one_run(r, pages, False, f"{geom}-{pages}:{r.kind}:warm", to)
        r.calls.clear()
        r.empty_v2.clear()
    kinds = [r.kind for r in everyone]
    t = {f"{k}_{m}": [] for k in kinds for m in ("idle", "busy")}
    rates, gaps = {k: [] for k in kinds}, {k: [] for k in kinds}
    sleeps = []
    for _ in range(args.runs):
        for mode in ("idle", "busy"):
            for r in everyone:   # the floors' runs right after mp's, same mode
                g0 = _gets(r)
                dt, sched = one_run(r, pages, mode == "busy", f"{geom}-{pages}:{r.kind}:{mode}", to)
                t[f"{r.kind}_{mode}"].append(dt)
                if r is nb and sl is not None and mode == "idle":
                    # as long as mp's idle batch of this run
                    sleeps.append(backend_of(sl.ctl).sleep_like(t["mp_idle"][-1], dt, mp_gets))
                if r is mp:
                    mp_gets = _gets(mp) - g0
                if mode == "busy":
                    rates[r.kind].append(sched.rate())
                    gaps[r.kind].append((sched.handoffs / r.requests,
                                         sched.handoff_s * 1e3 / r.requests))
    per = 2 * args.runs * mp.requests
    calls = {k: v / per for k, v in sorted(mp.calls.items())}
    res = figures(t, rates, calls, mp.requests, mp.round_bytes(pages))
    if sleeps:
        res["sleep_floor_sleep_ms"] = median(sleeps) * 1e3
    res.update(write_s=write_s, calls_per_request=calls,
               nobytes_calls_per_request={k: v / per for k, v in sorted(nb.calls.items())},
               empty_v2_calls_per_request={k: v / per for k, v in sorted(mp.empty_v2.items())},
               busy_gaps_per_request={k: [median([a for a, _ in v]), median([b for _, b in v])]
                                      for k, v in gaps.items()},
               wrong_pages=mp.wrong, checked_pages=mp.checked)
    if args.trace_runs and args.trace:
        # after the timed runs: the tracer's own Python on SGLang's threads
        # stays out of the timings
        TRACE.arm()
        for _ in range(args.trace_runs):
            for mode in ("idle", "busy"):
                for r in everyone:
                    one_run(r, pages, mode == "busy", f"{geom}-{pages}:{r.kind}:{mode}", to)
        for r in (mp, nb):   # backups of new prefixes under a busy scheduler
            with TRACE.round(f"{geom}-{pages}:{r.kind}:backup-busy"):
                ok = r.backup(pages, Scheduler(True), to, fresh=True)
            assert ok, f"{geom} {r.kind}: the traced backup failed"
        TRACE.disarm()
        res["wrong_pages"], res["checked_pages"] = mp.wrong, mp.checked
    if sl is not None:
        log(f"{geom:5s} {pages:4d} pages: sleeping floor ({res['sleep_floor_sleep_ms']:.1f} ms "
            f"per batch) busy/idle {res['sleeping_busy_over_idle']:.2f}, "
            f"{res['sleeping_ms_over_idle_per_round']:+.1f} ms/round; mp's own beyond it "
            f"{res['own_beyond_sleeping_ms_per_batch_get']:.2f} ms/batch_get")
    log(f"{geom:5s} {pages:4d} pages x {mp.requests}: mp idle {res['mp_idle_gbps']:.3f} GB/s, "
        f"busy/idle {res['mp_busy_over_idle']:.2f}, {res['mp_ms_over_idle_per_round']:+.1f} "
        f"ms/round; floor {res['nobytes_ms_over_idle_per_round']:+.1f} ms/round; own "
        f"{res['own_ms_per_request']:.2f} ms/request, {res['own_ms_per_batch_get']:.2f} "
        f"ms/batch_get; loop mp/floor {res['loop_rate_mp_over_floor']:.3f}; calls/request "
        f"{calls}; wrong pages {res['wrong_pages']} of {res['checked_pages']}")
    return res


def figures(t: dict, rates: dict, calls: dict, requests: int, request_bytes: int) -> dict:
    """Direct figures from the interleaved runs `t` (seconds per round of
    `requests` concurrent requests); `calls`: SGLang's calls per request."""
    out = {"runs_s": t, "requests_per_round": requests, "request_bytes": request_bytes}
    kinds = [k for k in ("mp", "nobytes", "sleeping") if t.get(f"{k}_idle")]
    for k in kinds:
        idle, busy = median(t[f"{k}_idle"]), median(t[f"{k}_busy"])
        out[f"{k}_busy_over_idle"] = idle / busy
        out[f"{k}_idle_ms_per_round"] = idle * 1e3
        out[f"{k}_busy_ms_per_round"] = busy * 1e3
        out[f"{k}_ms_over_idle_per_round"] = (busy - idle) * 1e3
        out[f"{k}_ms_over_idle_runs"] = [(b - i) * 1e3 for i, b in
                                        zip(t[f"{k}_idle"], t[f"{k}_busy"])]
        out[f"{k}_loop_rate"] = median(rates[k])
    moved = requests * request_bytes
    out["mp_idle_gbps"] = moved / median(t["mp_idle"]) / 1e9
    out["mp_busy_gbps"] = moved / median(t["mp_busy"]) / 1e9
    out["mp_busy_over_idle"] = median(t["mp_idle"]) / median(t["mp_busy"])
    out["mp_busy_over_idle_runs"] = [i / b for i, b in zip(t["mp_idle"], t["mp_busy"])]
    # the backend's own cost of a busy scheduler, run by run (each mp run beside its floor run)
    own = [((mb - mi) - (fb - fi)) * 1e3 for mi, mb, fi, fb in
           zip(t["mp_idle"], t["mp_busy"], t["nobytes_idle"], t["nobytes_busy"])]
    divisors = {"request": requests,
                "batch_get": requests * (sum(calls.get(c, 0) for c in GETS) or 1),
                "batch_get_v2": requests * (calls.get("batch_get_v2") or 1)}
    out["own_ms_per_round_runs"] = own
    for name, div in divisors.items():
        out[f"own_ms_per_{name}_runs"] = [x / div for x in own]
        out[f"own_ms_per_{name}"] = median(own) / div
    out["loop_rate_mp_over_floor"] = (out["mp_loop_rate"] / out["nobytes_loop_rate"]
                                      if out["nobytes_loop_rate"] else None)
    if "sleeping" in kinds:   # beyond SGLang's hand-offs plus one ideal wait per batch
        beyond = [((mb - mi) - (sb - si)) * 1e3 for mi, mb, si, sb in
                  zip(t["mp_idle"], t["mp_busy"], t["sleeping_idle"], t["sleeping_busy"])]
        out["own_beyond_sleeping_ms_per_batch_get_runs"] = [x / divisors["batch_get"]
                                                            for x in beyond]
        out["own_beyond_sleeping_ms_per_batch_get"] = median(beyond) / divisors["batch_get"]
        out["loop_rate_mp_over_sleeping"] = (out["mp_loop_rate"] / out["sleeping_loop_rate"]
                                             if out["sleeping_loop_rate"] else None)
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometries", default="mamba,swa,dsa")
    ap.add_argument("--round-pages", default="64,256",
                    help="KV pages per request (comma list: one set of figures each)")
    ap.add_argument("--requests", type=int, default=2,
                    help="concurrent prefetches per round (each its own prefix)")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs per mode")
    ap.add_argument("--trace-runs", type=int, default=2,
                    help="traced runs per mode after the timed ones (0: none)")
    ap.add_argument("--no-trace", dest="trace", action="store_false")
    ap.add_argument("--tiny", action="store_true", help="pages of a few KiB (CPU tests)")
    ap.add_argument("--sleep-floor", action="store_true",
                    help="also run the sleeping floor: no bytes, one sleep per batch_get as "
                         "long as mp's idle batch (SGLang's hand-offs plus one ideal wait)")
    ap.add_argument("--workers", type=int, default=None,
                    help="mp num_workers (default 8; 2 with --tiny: a small CPU box)")
    ap.add_argument("--timeout-s", type=float, default=120,
                    help="longest wait on one of SGLang's queues")
    ap.add_argument("--store", default=None,
                    help="directory for the stores' temp dir (removed at the end)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.workers is None:
        args.workers = 2 if args.tiny else 8
    args.round_pages = [int(x) for x in args.round_pages.split(",") if x]
    args.geometries = [x.strip() for x in args.geometries.split(",") if x.strip()]
    if not args.round_pages or min(args.round_pages) <= 0 or args.runs < 1 or args.requests < 1:
        ap.error("--round-pages, --runs and --requests must be positive")
    for gname in args.geometries:
        try:
            RH.geometry(gname)
        except ValueError as exc:
            ap.error(str(exc))
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    global TRACE
    # before SGLang's storage threads start: threading.setprofile reaches new ones only
    TRACE = GilTracer().install() if args.trace else NullTracer()
    TRACE.disarm()
    S = RH.load()
    import torch
    res = {"device": "cuda" if torch.cuda.is_available() else "cpu",
           "switch_interval_ms": sys.getswitchinterval() * 1e3,
           "args": vars(args), "loop_rate_alone": loop_rate_alone(0.3), "geometries": {}}
    root = tempfile.mkdtemp(dir=args.store, prefix="hicache_mp_hybrid_")
    try:
        for geom in args.geometries:
            res["geometries"][geom] = run_geometry(S, geom, args, root)
            write(args.json, res)   # so far: a run cut short by a time limit keeps these
    finally:
        TRACE.uninstall()
        shutil.rmtree(root, ignore_errors=True)
    if args.trace:
        res["gil_trace"] = TRACE.report()
        res["gil_trace_table"] = ["| round | backend call | calls | C calls > 1 ms per call | "
                                  "gaps > 2 ms per call | ms per call | top site |"]
        for label in res["gil_trace"]:
            if not label.endswith(":warm"):
                res["gil_trace_table"] += trace_table(res["gil_trace"], label)
        for row in res["gil_trace_table"]:
            print(row, flush=True)
    res["summary"] = summary(res)
    print(json.dumps({"summary": res["summary"]}, indent=1), flush=True)
    write(args.json, res)
    return res


def write(path, res) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)


def summary(res: dict) -> dict:
    keys = ("mp_idle_gbps", "mp_busy_gbps", "mp_busy_over_idle", "mp_ms_over_idle_per_round",
            "nobytes_ms_over_idle_per_round", "own_ms_per_request", "own_ms_per_batch_get",
            "own_ms_per_batch_get_v2", "own_ms_per_request_runs", "own_ms_per_batch_get_runs",
            "loop_rate_mp_over_floor", "calls_per_request", "empty_v2_calls_per_request",
            "wrong_pages", "nobytes_busy_over_idle", "sleeping_busy_over_idle",
            "sleeping_ms_over_idle_per_round", "sleep_floor_sleep_ms",
            "own_beyond_sleeping_ms_per_batch_get", "own_beyond_sleeping_ms_per_batch_get_runs",
            "loop_rate_mp_over_sleeping")
    out = {f"{g}-{n}": {k: r[k] for k in keys if k in r} for g, geo in res["geometries"].items()
           for n, r in geo["sizes"].items()}
    out["wrong_pages"] = sum(v["wrong_pages"] for v in out.values())
    return out


if __name__ == "__main__":
    r = main()
    sys.exit(1 if r["summary"]["wrong_pages"] else 0)
