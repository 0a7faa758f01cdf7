"""Hybrid-model prefetch through SGLang 0.5.23's real host pools: `mp` against the
no-bytes floor, idle and under a busy scheduler, with the GIL tracer.

Geometries (scripts/sglang_real_hybrid.py, SGLang's own host-pool classes on
the "shm" allocator): `mamba` (Qwen3-Next: MHA KV + one Mamba state per
prefix), `swa` (gpt-oss: MHA KV + a sliding-window pool of the last 2 pages)
and `dsa` (DeepSeek-V3.2: MLA KV + the DSA indexer, read with every KV page).
The backends are built by SGLang's StorageBackendFactory from the dynamic
config: `mp` (hicache_mp's HiCacheMP) and `nobytes` (scripts/sglang_nobytes.py:
every call answered at once, no bytes moved: SGLang's own side of a round).

The calls are the ones SGLang's HybridCacheController makes from its storage
threads (hybrid_cache_controller.py / cache_controller.py, 0.5.23), made by
this script on a storage thread of its own (the controller object itself
needs a HostPoolGroup and a device-side model): backup = `batch_set_v2` of
the sidecars, then `batch_set_v1` of the KV pages per 128-page batch;
prefetch = `batch_exists_v2` over the prefix with its pool transfers, then
per 128-page batch `batch_get_v1` of the KV pages (and, for KV-derived pools
such as the DSA indexer, `batch_get_v2` of the same batch), then
`batch_get_v2` of the trailing sidecar (Mamba, SWA).

A run is `--requests` prefetches of `--round-pages` KV pages each, on the
storage thread, while the main thread (the scheduler, the thread the tracer
skips) either waits (idle) or runs pure-Python bookkeeping (busy) that calls
nothing that lets the GIL go. The no-bytes run of the same mode follows each
mp run. Figures per geometry and round size (medians of --runs, with the
per-run values): busy / idle GB/s, ms over idle per round, the backend's own
cost of a busy scheduler per `batch_get_v2` call and per request
((mp busy - mp idle) - (nobytes busy - nobytes idle)), the busy loop's rate
mp / floor, and wrong pages (every KV and sidecar page read is compared with
the page written). Then `--trace-runs` traced runs per mode (and one traced
backup) give the tracer's per-call table. Owns no engine logic.

    PYTHONPATH=. python3 scripts/sglang_hybrid_check.py --json $OUT/hybrid.json
    # small CPU run:
    PYTHONPATH=. python3 scripts/sglang_hybrid_check.py --tiny --round-pages 4 --runs 2
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import sglang_hybrid_rank as HR  # noqa: E402
from giltrace import GilTracer, NullTracer, table as trace_table  # noqa: E402

CHUNK = 256      # busy-loop iterations between two time stamps (~15 us of Python)
GAP_S = 0.5e-3   # a longer gap between stamps: another thread held the GIL that long


def log(msg: str) -> None:
    print(f"[sglang_hybrid_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


TRACE = NullTracer()  # GilTracer() once main() installs it (--trace)


class Busy:
    """The scheduler's loop: pure Python (integer arithmetic, one attribute
    read, perf_counter) until the storage thread says it is done. No lock,
    queue, I/O, torch or numpy call: nothing here lets the GIL go, so every
    hand-off is the other threads' doing."""

    def __init__(self):
        self.done = False
        self.iters, self.gaps, self.gap_s, self.seconds = 0, 0, 0.0, 0.0

    def run(self) -> None:
        x, n, gaps, gap_s = 1, 0, 0, 0.0
        clock = time.perf_counter
        t0 = last = clock()
        while True:   # one chunk at least: the storage thread may be done before this starts
            for i in range(CHUNK):
                x = (x * 1103515245 + i) & 0xFFFFFFFF
            n += CHUNK
            now = clock()
            if now - last > GAP_S:
                gaps += 1
                gap_s += now - last
            last = now
            if self.done:
                break
        self.iters, self.gaps, self.gap_s, self.seconds = n, gaps, gap_s, clock() - t0

    def rate(self) -> float:
        return self.iters / self.seconds if self.seconds > 0 else 0.0


def loop_rate_alone(seconds: float = 0.3) -> float:
    """The busy loop's rate with no other thread running (the reference)."""
    loop = Busy()
    threading.Timer(seconds, lambda: setattr(loop, "done", True)).start()
    loop.run()
    return loop.rate()


def timed(fn, busy: bool):
    """fn() on a storage thread; (seconds, fn's result, Busy or None)."""
    result, err, loop = [], [], Busy() if busy else None

    def storage_thread():
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised on the main thread
            err.append(exc)
        finally:
            if loop is not None:
                loop.done = True

    th = threading.Thread(target=storage_thread, name="hicache-storage")
    t0 = time.perf_counter()
    th.start()
    if loop is not None:
        loop.run()
    th.join()
    dt = time.perf_counter() - t0
    if err:
        raise err[0]
    return dt, result[0], loop


def one_run(rank, pages: int, busy: bool, label: str):
    """A run of rank.requests prefetches; (seconds, Busy or None). Raises on a short hit."""
    rank.clear_dst(pages)
    with TRACE.round(label):
        dt, done, loop = timed(lambda: [rank.prefetch(pages, r) for r in range(rank.requests)],
                               busy)
    if done != [pages] * rank.requests:
        raise AssertionError(f"{label}: pages hit per request {done}, wanted {pages}")
    rank.check(pages)
    return dt, loop


def median(xs):
    return statistics.median(xs) if xs else None


def run_geometry(S, hs, geom: str, args, root: str) -> dict:
    g = HR.RH.geometry(geom, tiny=args.tiny)
    top = max(args.round_pages)
    ranks = {}
    try:
        for kind in ("mp", "nobytes"):
            store = os.path.join(root, f"{geom}-{kind}")
            os.makedirs(store, exist_ok=True)
            ranks[kind] = HR.Rank(S, hs, g, kind, store, requests=args.requests,
                                  max_pages=top, workers=args.workers)
        mp, nb = ranks["mp"], ranks["nobytes"]
        out = {"model": g["model"], "page_bytes": mp.page_bytes(), "sizes": {}}
        for pages in args.round_pages:
            out["sizes"][str(pages)] = run_size(mp, nb, geom, pages, args)
        out["metrics"] = {k: v for k, v in mp.backend.metrics().items()
                          if k.startswith("sidecar")}
        return out
    finally:
        for r in ranks.values():
            r.close()


def run_size(mp, nb, geom, pages, args) -> dict:
    for r in (mp, nb):
        t0 = time.perf_counter()
        for q in range(r.requests):
            if not r.backup(pages, q):
                raise AssertionError(f"{geom} {r.kind}: a backup of {pages} pages failed")
        if r is mp:
            write_s = time.perf_counter() - t0
        r.calls.clear()
    for r in (mp, nb):   # warm: the first run pays the index and page cache
        one_run(r, pages, False, f"{geom}-{pages}:{r.kind}:warm")
    mp.calls.clear()
    nb.calls.clear()
    t = {f"{k}_{m}": [] for k in ("mp", "nobytes") for m in ("idle", "busy")}
    rates = {"mp": [], "nobytes": []}
    gaps = {"mp": [], "nobytes": []}
    for _ in range(args.runs):
        for mode in ("idle", "busy"):
            for r in (mp, nb):   # the floor's run right after mp's, same mode
                dt, loop = one_run(r, pages, mode == "busy", f"{geom}-{pages}:{r.kind}:{mode}")
                t[f"{r.kind}_{mode}"].append(dt)
                if loop is not None:
                    rates[r.kind].append(loop.rate())
                    gaps[r.kind].append((loop.gaps / r.requests, loop.gap_s * 1e3 / r.requests))
    calls = {k: v / (2 * args.runs * mp.requests) for k, v in sorted(mp.calls.items())}
    res = figures(t, rates, calls, mp.requests, mp.round_bytes(pages))
    res.update(write_s=write_s, calls_per_request=calls,
               busy_gaps_per_request={k: [median([a for a, _ in v]), median([b for _, b in v])]
                                      for k, v in gaps.items()},
               wrong_pages=mp.wrong, checked_pages=mp.checked)
    if args.trace_runs and args.trace:
        # after the timed runs: the tracer's own Python on the storage thread
        # stays out of the timings
        TRACE.arm()
        for _ in range(args.trace_runs):
            for mode in ("idle", "busy"):
                for r in (mp, nb):
                    one_run(r, pages, mode == "busy", f"{geom}-{pages}:{r.kind}:{mode}")
        for r in (mp, nb):   # backup submissions under a busy scheduler
            with TRACE.round(f"{geom}-{pages}:{r.kind}:backup-busy"):
                ok = timed(lambda r=r: r.backup(pages, 0, fresh=True), True)[1]
            assert ok, f"{geom} {r.kind}: the traced backup failed"
        TRACE.disarm()
        res["wrong_pages"], res["checked_pages"] = mp.wrong, mp.checked
    log(f"{geom:5s} {pages:4d} pages: mp idle {res['mp_idle_gbps']:.3f} GB/s, busy/idle "
        f"{res['mp_busy_over_idle']:.2f}, {res['mp_ms_over_idle_per_round']:+.1f} ms/round; floor "
        f"{res['nobytes_ms_over_idle_per_round']:+.1f} ms/round; own "
        f"{res['own_ms_per_request']:.2f} ms/request, "
        f"{res['own_ms_per_batch_get_v2']:.2f} ms/batch_get_v2; loop mp/floor "
        f"{res['loop_rate_mp_over_floor']:.3f}; wrong pages {res['wrong_pages']} of "
        f"{res['checked_pages']}")
    return res


def figures(t: dict, rates: dict, calls: dict, requests: int, round_bytes: int) -> dict:
    """Direct figures from the interleaved runs `t` (seconds per run of `requests`)."""
    out = {"runs_s": t, "round_bytes": round_bytes}
    for k in ("mp", "nobytes"):
        idle, busy = median(t[f"{k}_idle"]), median(t[f"{k}_busy"])
        out[f"{k}_idle_ms_per_round"] = idle * 1e3 / requests
        out[f"{k}_busy_ms_per_round"] = busy * 1e3 / requests
        out[f"{k}_ms_over_idle_per_round"] = (busy - idle) * 1e3 / requests
        out[f"{k}_ms_over_idle_runs"] = [(b - i) * 1e3 / requests
                                        for i, b in zip(t[f"{k}_idle"], t[f"{k}_busy"])]
        out[f"{k}_loop_rate"] = median(rates[k])
    out["mp_idle_gbps"] = requests * round_bytes / median(t["mp_idle"]) / 1e9
    out["mp_busy_gbps"] = requests * round_bytes / median(t["mp_busy"]) / 1e9
    out["mp_busy_over_idle"] = median(t["mp_idle"]) / median(t["mp_busy"])
    out["mp_busy_over_idle_runs"] = [i / b for i, b in zip(t["mp_idle"], t["mp_busy"])]
    # the backend's own cost of a busy scheduler, run by run (each mp run beside its floor run)
    own = [((mb - mi) - (fb - fi)) * 1e3 / requests for mi, mb, fi, fb in
           zip(t["mp_idle"], t["mp_busy"], t["nobytes_idle"], t["nobytes_busy"])]
    v2 = calls.get("batch_get_v2") or 1
    out["own_ms_per_request_runs"] = own
    out["own_ms_per_request"] = median(own)
    out["own_ms_per_batch_get_v2_runs"] = [x / v2 for x in own]
    out["own_ms_per_batch_get_v2"] = median(own) / v2
    out["loop_rate_mp_over_floor"] = (out["mp_loop_rate"] / out["nobytes_loop_rate"]
                                      if out["nobytes_loop_rate"] else None)
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometries", default="mamba,swa,dsa")
    ap.add_argument("--round-pages", default="64,256",
                    help="KV pages per request (comma list: one set of figures each)")
    ap.add_argument("--requests", type=int, default=2, help="prefetches per timed run")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs per mode")
    ap.add_argument("--trace-runs", type=int, default=2,
                    help="traced runs per mode after the timed ones (0: none)")
    ap.add_argument("--no-trace", dest="trace", action="store_false")
    ap.add_argument("--tiny", action="store_true", help="pages of a few KiB (CPU tests)")
    ap.add_argument("--workers", type=int, default=8, help="mp num_workers")
    ap.add_argument("--store", default=None,
                    help="directory for the stores' temp dir (removed at the end)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.round_pages = [int(x) for x in args.round_pages.split(",") if x]
    args.geometries = [x.strip() for x in args.geometries.split(",") if x.strip()]
    if not args.round_pages or min(args.round_pages) <= 0 or args.runs < 1 or args.requests < 1:
        ap.error("--round-pages, --runs and --requests must be positive")
    for gname in args.geometries:
        try:
            HR.RH.geometry(gname)
        except ValueError as exc:
            ap.error(str(exc))
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    global TRACE
    # before any storage thread starts: threading.setprofile reaches new ones only
    TRACE = GilTracer().install() if args.trace else NullTracer()
    TRACE.disarm()
    S = HR.RH.load()
    import sglang.srt.mem_cache.hicache_storage as hs
    import torch
    res = {"device": "cuda" if torch.cuda.is_available() else "cpu",
           "switch_interval_ms": sys.getswitchinterval() * 1e3,
           "args": vars(args), "loop_rate_alone": loop_rate_alone(), "geometries": {}}
    root = tempfile.mkdtemp(dir=args.store, prefix="hicache_mp_hybrid_")
    try:
        for geom in args.geometries:
            res["geometries"][geom] = run_geometry(S, hs, geom, args, root)
            write(args.json, res)   # so far: a run cut short by a time limit keeps these
    finally:
        TRACE.uninstall()
        import shutil
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
    keys = ("mp_idle_gbps", "mp_busy_over_idle", "mp_ms_over_idle_per_round",
            "nobytes_ms_over_idle_per_round", "own_ms_per_request", "own_ms_per_batch_get_v2",
            "own_ms_per_request_runs", "loop_rate_mp_over_floor", "calls_per_request",
            "wrong_pages")
    out = {f"{g}-{n}": {k: r[k] for k in keys} for g, geo in res["geometries"].items()
           for n, r in geo["sizes"].items()}
    out["wrong_pages"] = sum(v["wrong_pages"] for v in out.values())
    return out


if __name__ == "__main__":
    r = main()
    sys.exit(1 if r["summary"]["wrong_pages"] else 0)
