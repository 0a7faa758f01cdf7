"""SGLang's stock storage path against the fast path, interleaved in one run.

Each backend gets two stacks over SGLang's real controllers: one built while
SGLang's classes are stock, one built after
`hicache_mp.integrations.sglang.fastpath.install()`. Every run plays, per
mode (idle, busy scheduler) and variant (stock, fast), one prefetch round on
that variant's stack, with the classes set to the variant just before it
(install / uninstall between rounds: a stack only runs while its variant is
in place, so its threads' loops and the methods they call agree). Dense
(`HiCacheController`, bench/sglang/stack.py's Stack): the sleeping floor
(no bytes, one GIL-releasing sleep per batch_get_v1 as long as mp's stock
idle batch of that run, decision 86), `mp` and SGLang's `file`. Hybrid
(`HybridCacheController`, hybrid_rank's Rank; Mamba, SWA, DSA at each
--hybrid-pages): the sleeping floor and `mp`. Every page mp and file read is
compared with the page written.

Prints per stack: idle and busy medians (ms) and busy ÷ idle (idle time over
busy time: the share of its idle speed it keeps), stock beside fast; the
busy loop's it/s in its busy rounds (beside the loop alone) and the ms of a
busy round the loop did not run (busy ms x (1 - it/s / alone): what the
storage path took from the scheduler); and the wrong pages; with --trace, then SGLang's own waits per batch on its storage
threads for one traced prefetch of each variant (bench/sglang/handoffs.py).
Owns no engine logic; changes SGLang only through fastpath.install().

    python3 scripts/sglang_fastpath_bench.py --runs 5 --json $OUT/fastpath.json
    python3 scripts/sglang_fastpath_bench.py --tiny --runs 2     # a CPU check
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

from hicache_mp.bench.giltrace import GilTracer
from hicache_mp.bench.sglang import handoffs
from hicache_mp.bench.sglang import hybrid_rank as HR
from hicache_mp.bench.sglang import real as R
from hicache_mp.bench.sglang import real_hybrid as RH
from hicache_mp.bench.sglang import stack as S
from hicache_mp.engine.config import auto_workers
from hicache_mp.integrations.sglang import fastpath

VARIANTS = ("stock", "fast")
MODES = ("idle", "busy")


def variant(name: str) -> None:
    """SGLang's classes as `name` has them."""
    if name == "fast":
        fastpath.install()
    else:
        fastpath.uninstall()


@contextlib.contextmanager
def switch_interval(mode: str, ms: float):
    """Busy rounds under `ms` (0: Python's own 5 ms): a longer interval makes
    each return to the GIL cost more, so their count shows above a noisy box."""
    old = sys.getswitchinterval()
    if mode == "busy" and ms:
        sys.setswitchinterval(ms / 1e3)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def median(xs):
    return statistics.median(xs) if xs else None


def ratio(times: dict, loop: list) -> dict:
    """Medians of the idle and busy rounds, and of the busy loop's it/s in
    its busy rounds (what the scheduler kept of the CPU while storage work ran)."""
    idle, busy = median(times["idle"]), median(times["busy"])
    return {"idle_ms": idle * 1e3, "busy_ms": busy * 1e3, "busy_over_idle": idle / busy,
            "busy_loop_its": median(loop), "runs_s": times, "busy_loop_its_runs": loop}


# --- dense -------------------------------------------------------------------------------
def dense(sgl, args, root) -> dict:
    stacks = {}
    try:
        for v in VARIANTS:
            variant(v)
            for b in args.backends:
                store = os.path.join(root, f"{v}-{b}")
                os.makedirs(store, exist_ok=True)
                s = stacks[v, b] = S.Stack(sgl, b, args, store)
                if b != "sleeping":
                    S.backup(s.ctl, s.src, s.tokens, s.hashes, S.Scheduler(False), args.timeout_s)
                s.read(S.Scheduler(False))   # warm: the index, the page cache, first calls
        times = {k: {m: [] for m in MODES} for k in stacks}
        loop = {k: [] for k in stacks}
        gets = -(-stacks["stock", args.backends[0]].pages // max(1, args.requests) // 128) * \
            max(1, args.requests)
        for _ in range(args.runs):
            for mode in MODES:
                for v in VARIANTS:
                    variant(v)
                    for b in args.backends:
                        s = stacks[v, b]
                        if b == "sleeping":
                            if ("stock", "mp") in stacks and times["stock", "mp"]["idle"]:
                                S.backend_of(s.ctl).sleep_like(
                                    times["stock", "mp"]["idle"][-1], 0.0, gets)
                        sched = S.Scheduler(mode == "busy")
                        with switch_interval(mode, args.switch_interval_ms):
                            t, done = s.read(sched)
                        if done != len(s.tokens):
                            raise AssertionError(f"dense {v} {b} {mode}: {done} tokens read")
                        times[v, b][mode].append(t)
                        if mode == "busy":
                            loop[v, b].append(sched.rate())
        return {f"{b}:{v}": dict(ratio(times[v, b], loop[v, b]), wrong_pages=stacks[v, b].wrong_pages,
                                 checked_pages=stacks[v, b].checked_pages)
                for (v, b) in stacks}
    finally:
        for s in stacks.values():
            s.close()
        fastpath.uninstall()


# --- hybrid ------------------------------------------------------------------------------
def hybrid(args, root) -> dict:
    S_ = RH.load()
    out = {}
    for geom in args.geometries:
        g = RH.geometry(geom, tiny=args.tiny)
        for pages in args.hybrid_pages:
            ranks = {}
            try:
                for v in VARIANTS:
                    variant(v)
                    for kind in ("sleeping", "mp"):
                        store = os.path.join(root, f"h-{geom}-{pages}-{v}-{kind}")
                        os.makedirs(store, exist_ok=True)
                        r = ranks[v, kind] = HR.Rank(S_, g, kind, store, requests=args.requests,
                                                     max_pages=pages, workers=args.workers)
                        r.backup(pages, S.Scheduler(False), args.timeout_s)
                        r.finish(pages, r.prefetch(pages, S.Scheduler(False),
                                                   args.timeout_s)[1], "warm")
                times = {k: {m: [] for m in MODES} for k in ranks}
                loop = {k: [] for k in ranks}
                gets = -(-pages // 128) * args.requests + args.requests   # KV batches + sidecar
                for _ in range(args.runs):
                    for mode in MODES:
                        for v in VARIANTS:
                            variant(v)
                            for kind in ("mp", "sleeping"):
                                r = ranks[v, kind]
                                if kind == "sleeping":
                                    S.backend_of(r.ctl).sleep_like(
                                        times["stock", "mp"]["idle"][-1], 0.0, gets)
                                sched = S.Scheduler(mode == "busy")
                                with switch_interval(mode, args.switch_interval_ms):
                                    t, res = r.prefetch(pages, sched, args.timeout_s)
                                r.finish(pages, res, f"{geom} {pages} {v} {kind} {mode}")
                                times[v, kind][mode].append(t)
                                if mode == "busy":
                                    loop[v, kind].append(sched.rate())
                for (v, kind), r in ranks.items():
                    out[f"{geom}:{pages}:{kind}:{v}"] = dict(ratio(times[v, kind], loop[v, kind]),
                                                             wrong_pages=r.wrong,
                                                             checked_pages=r.checked)
            finally:
                for r in ranks.values():
                    r.close()
                fastpath.uninstall()
    return out


# --- the hand-offs of traced prefetches per variant ---------------------------------------
def trace(sgl, args, root) -> dict:
    """Idle: SGLang's waits per batch of one dense (2 batches) and one hybrid
    prefetch, named (handoffs.HandoffTracer). Busy: the GIL tracer over
    --trace-runs busy rounds of each variant's own dense `mp` stack (this
    run's geometry) and hybrid Mamba rank: SGLang's returns to the GIL per
    batch on its storage threads outside the backend's calls (C calls over
    1 ms and gaps over 2 ms), beside the backend's."""
    tr = handoffs.HandoffTracer().install()
    out = {}
    try:
        for v in VARIANTS:
            variant(v)
            d = handoffs.dense_prefetch(tr, f"dense:{v}", "mp", os.path.join(root, f"t-{v}"))
            h = handoffs.hybrid_prefetch(tr, f"hybrid:{v}", "mamba", os.path.join(root, f"th-{v}"))
            for label, res in ((f"dense:{v}", d), (f"hybrid:{v}", h)):
                out[label] = {"sglang_waits_per_batch": tr.sglang_waits(label) / res["batches"],
                              "rows": tr.table(label)}
    finally:
        tr.uninstall()
        fastpath.uninstall()
    out["tensor_item_releases_gil"] = handoffs.item_releases_gil()
    if args.trace_runs:
        out["busy"] = busy_trace(sgl, args, root)
    return out


def _storage_threads(ctl) -> set:
    """The names of `ctl`'s storage threads (SGLang's: 'Thread-N (target)')."""
    return {t.name for t in (getattr(ctl, a, None) for a in (
        "prefetch_thread", "prefetch_io_aux_thread", "prefetch_sync_thread", "backup_thread",
        "pp_prefetch_command_thread")) if isinstance(t, threading.Thread)}


def busy_trace(sgl, args, root) -> dict:
    gil = GilTracer().install()   # before the stacks: their threads are the ones watched
    gil.disarm()
    stacks, out = {}, {}
    try:
        for v in VARIANTS:
            variant(v)
            store = os.path.join(root, f"b-{v}")
            os.makedirs(store, exist_ok=True)
            s = S.Stack(sgl, "mp", args, store)
            S.backup(s.ctl, s.src, s.tokens, s.hashes, S.Scheduler(False), args.timeout_s)
            s.read(S.Scheduler(False))
            r = HR.Rank(RH.load(), RH.geometry("mamba", tiny=args.tiny), "mp", store + "-h",
                        requests=args.requests, max_pages=args.hybrid_pages[0],
                        workers=args.workers)
            r.backup(args.hybrid_pages[0], S.Scheduler(False), args.timeout_s)
            r.finish(args.hybrid_pages[0], r.prefetch(args.hybrid_pages[0], S.Scheduler(False),
                                                      args.timeout_s)[1], "warm")
            stacks[v] = (s, r)
        gil.arm()
        for _ in range(args.trace_runs):
            for v in VARIANTS:
                variant(v)
                s, r = stacks[v]
                with gil.round(f"dense:{v}"):
                    s.read(S.Scheduler(True))
                with gil.round(f"hybrid:{v}"):
                    _, res = r.prefetch(args.hybrid_pages[0], S.Scheduler(True), args.timeout_s)
                r.finish(args.hybrid_pages[0], res, "traced")
        gil.disarm()
        dense_batches = -(-s.pages // max(1, args.requests) // 128) * max(1, args.requests)
        hybrid_batches = -(-args.hybrid_pages[0] // 128) * args.requests
        for v in VARIANTS:
            for part, batches, ctl in (("dense", dense_batches, stacks[v][0].ctl),
                                       ("hybrid", hybrid_batches, stacks[v][1].ctl)):
                label = f"{part}:{v}"
                # the traced controller's own threads: every stack's idle threads
                # run (and poll) beside it, and are not this round's
                mine = _storage_threads(ctl)
                recs = [x for x in gil.records if x[0] == label and x[7] in mine]
                own = [x for x in recs if x[1] == "-" and x[3] != "timeout"]
                backend = [x for x in recs if x[1] != "-" and x[3] != "timeout"]
                n = args.trace_runs * batches
                sites = {}
                for x in own:
                    sites[f"{x[3]} {x[4]} {x[5]}"] = sites.get(f"{x[3]} {x[4]} {x[5]}", 0) + 1 / n
                out[label] = {"sglang_returns_per_batch": len(own) / n,
                              "backend_returns_per_batch": len(backend) / n,
                              "idle_timeouts_per_batch": sum(x[3] == "timeout"
                                                             for x in recs) / n,
                              "sglang_sites_per_batch": sites}
    finally:
        gil.uninstall()
        for s, r in stacks.values():
            s.close()
            r.close()
        fastpath.uninstall()
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="sleeping,mp,file",
                    help="dense backends (sleeping: the sleeping floor; needs mp before it "
                         "sleeps as long as mp's batch)")
    ap.add_argument("--round-mib", type=float, default=2048)
    ap.add_argument("--page-mib", type=float, default=8.0)
    ap.add_argument("--file-round-mib", type=float, default=None,
                    help="bytes per round for SGLang's file backend (default: --round-mib; "
                         "it reads at a fraction of a GB/s under a busy scheduler)")
    ap.add_argument("--geometries", default="mamba,swa,dsa", help="hybrid; '' to skip")
    ap.add_argument("--hybrid-pages", default="64,256", help="KV pages per hybrid request")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workers", type=int, default=0,
                    help="hicache_mp num_workers of every mp engine (0: what one engine alone "
                         "would start here, given to each, so the stock and fast engines, "
                         "alive together, get the same count)")
    ap.add_argument("--tiny", action="store_true",
                    help="a CPU check: 4 MiB dense rounds of 64 KiB pages, tiny hybrid "
                         "geometries, 4 KV pages")
    ap.add_argument("--switch-interval-ms", type=float, default=0.0,
                    help="busy rounds under this sys.setswitchinterval (0: Python's 5 ms); "
                         "e.g. 50 on a small shared box, where a 5 ms return is lost in noise")
    ap.add_argument("--no-trace", dest="trace", action="store_false")
    ap.add_argument("--trace-runs", type=int, default=3,
                    help="busy rounds per variant under the GIL tracer (0: none), after the "
                         "timed ones, on stacks of their own")
    ap.add_argument("--timeout-s", type=float, default=120)
    ap.add_argument("--store", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not args.workers and not args.tiny:
        # Auto per engine would split the node's workers between the stock and
        # the fast engines, which live side by side here, first come first
        # served: the fast engine got fewer workers (the H200 run: its idle
        # round 500 ms to the stock engine's 71).
        args.workers = auto_workers()
    dense_argv = ["--round-mib", str(args.round_mib), "--page-mib", str(args.page_mib),
                  "--file-round-mib", str(args.file_round_mib or args.round_mib),
                  "--requests", str(args.requests), "--workers", str(args.workers),
                  "--timeout-s", str(args.timeout_s)]
    if args.tiny:
        dense_argv = ["--round-mib", "4", "--page-mib", "0.0625", "--layers", "2", "--heads",
                      "4", "--head-dim", "64", "--requests", str(args.requests), "--workers",
                      str(args.workers or 1), "--timeout-s", str(args.timeout_s)]
        args.hybrid_pages = "4"
        args.workers = args.workers or 1
    d = S.parse(dense_argv)
    for k in ("page_size", "round_pages", "file_round_pages", "layers", "heads", "head_dim",
              "layout", "mp_key", "node_engines"):
        if hasattr(d, k):
            setattr(args, k, getattr(d, k))
    args.backends = [b for b in args.backends.split(",") if b]
    if "sleeping" in args.backends and "mp" in args.backends:
        args.backends.remove("sleeping")   # after mp: its sleep is mp's idle batch of the run
        args.backends.insert(args.backends.index("mp") + 1, "sleeping")
    args.geometries = [g for g in args.geometries.split(",") if g]
    args.hybrid_pages = [int(p) for p in str(args.hybrid_pages).split(",")]
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    sgl = R.import_stack()
    res = {"args": {k: v for k, v in vars(args).items() if k != "mp_key"}}
    def save(part: str) -> None:
        # Each part is written as it ends, so a run cut short by a time
        # limit still leaves what it measured.
        print(f"fastpath bench: {part} done", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)

    # the busy loop's it/s with no storage work, beside each stack's in its busy rounds
    res["loop_its_alone"] = S.loop_rate_alone()
    with tempfile.TemporaryDirectory(dir=args.store, prefix="hicache_mp-fastpath-") as root:
        res["dense"] = dense(sgl, args, root) if args.backends else {}
        save("dense")
        res["hybrid"] = hybrid(args, root) if args.geometries else {}
        save("hybrid")
        if args.trace:
            res["trace"] = trace(sgl, args, root)
    alone = res["loop_its_alone"]
    for part in ("dense", "hybrid"):
        for r in res[part].values():
            # the scheduler's time another thread held the GIL in a busy round:
            # a shorter round at a lower it/s can still take less of it
            r["busy_loop_lost_ms"] = r["busy_ms"] * max(0.0, 1 - r["busy_loop_its"] / alone)
    print(f"busy loop alone: {alone / 1e6:.2f} M it/s")
    print("| stack | variant | idle ms | busy ms | busy ÷ idle | busy loop M it/s | "
          "loop's ms lost per round | wrong pages |")
    print("|---|---|---|---|---|---|---|---|")
    for part in ("dense", "hybrid"):
        for key, r in res[part].items():
            name, v = key.rsplit(":", 1)
            print(f"| {part} {name} | {v} | {r['idle_ms']:.1f} | {r['busy_ms']:.1f} | "
                  f"{r['busy_over_idle']:.2f} | {r['busy_loop_its'] / 1e6:.2f} | "
                  f"{r['busy_loop_lost_ms']:.1f} | {r['wrong_pages']} |")
    for label, t in res.get("trace", {}).items():
        if isinstance(t, dict) and "sglang_waits_per_batch" in t:
            print(f"{label} idle: SGLang's own waits per batch on its storage threads: "
                  f"{t['sglang_waits_per_batch']:.2f}")
    for label, t in res.get("trace", {}).get("busy", {}).items():
        print(f"{label} busy (GIL tracer): SGLang's returns to the GIL per batch "
              f"{t['sglang_returns_per_batch']:.2f}, the backend's {t['backend_returns_per_batch']:.2f}"
              f" (idle threads' poll timeouts, not counted: {t['idle_timeouts_per_batch']:.2f})")
    if "trace" in res:
        print(f"Tensor.item lets the GIL go in this torch: {res['trace']['tensor_item_releases_gil']}")
    res["wrong_pages"] = sum(r["wrong_pages"] for p in ("dense", "hybrid") for r in res[p].values())
    print(json.dumps({"wrong_pages": res["wrong_pages"]}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
