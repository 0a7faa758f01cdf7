#!/usr/bin/env python3
"""Scheduler-side cost of poll() per drained completion, bulk against page by page.

A scheduler that polls once per step (SGLang does, every few to tens of ms)
drains a step's worth of completions in one poll(). This lets every page of
the ops land first (the workers' page counters say when), then times the one
poll() that drains them, for several drain sizes, twice in the same run: with
the engine's own choice (bulk accounting, OpLedger.apply_many, for the
pages of one op from hicache_mp.engine.prefetch.BATCH_APPLY_MIN up, else page by page),
with bulk forced, and with page by page forced. Prints µs per completion and
the ratio of page by page to the engine's choice.

    python scripts/bench_poll.py                 # tiny pages, 2 workers
    python scripts/bench_poll.py --sizes 16 256 4096 --repeats 5

With --in-flight N it times instead every poll() of a loop that keeps N
ops in flight, as a scheduler with N requests prefetching calls it once per
step (docs/design.md §5: median <= 2 µs, p99 <= 20 µs at 24): median, p99
and max over all calls, and the same for the calls that drained nothing
and those that drained pages, over --rounds rounds of N ops, interleaved
with nothing else:

    python scripts/bench_poll.py --in-flight 24 --workers 14 --page-kib 8192 --pages 1024
"""
import argparse
import os
import statistics
import sys
import tempfile
import time


import hicache_mp.engine.prefetch as engine_mod
from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from workers.control import PAGES


def landed(eng) -> int:
    return int(sum(int(eng._control.workers[i][PAGES]) for i in range(len(eng._pool))))


def one_drain(eng, keys, ops_per_drain: int) -> float:
    """µs per completion of the one poll() that drains `keys` read as `ops_per_drain` ops."""
    n = len(keys)
    size = max(1, n // ops_per_drain)
    before = landed(eng)
    ops = [eng.prefetch(keys[i:i + size], range(i, min(n, i + size))) for i in range(0, n, size)]
    deadline = time.monotonic() + 30
    while landed(eng) < before + n:  # every page pushed to a completion ring; none drained yet
        if time.monotonic() > deadline:
            raise RuntimeError("pages did not land within 30 s")
        time.sleep(0.001)
    t0 = time.perf_counter_ns()
    eng.poll()
    dt = time.perf_counter_ns() - t0
    for op in ops:
        if not eng.wait(op, 30) or op.status != "ok":
            raise RuntimeError(f"prefetch ended {op.status}: {op.status_counts()}")
    return dt / n / 1e3


def in_flight(eng, keys, n_ops: int, rounds: int) -> dict:
    """Every poll() of a loop that keeps `n_ops` ops over `keys` in flight,
    `rounds` times: ns per call, split by whether it drained pages."""
    per = max(1, len(keys) // n_ops)
    empty, full = [], []
    clock = time.perf_counter_ns
    for _ in range(rounds):
        ops = [eng.prefetch(keys[i * per:(i + 1) * per], range(i * per, (i + 1) * per))
               for i in range(n_ops)]
        while not all(op.done for op in ops):
            t = clock()
            got = eng.poll()
            dt = clock() - t
            (full if got else empty).append(dt)
        bad = [op for op in ops if op.status != "ok"]
        if bad:
            raise RuntimeError(f"prefetch ended {bad[0].status}: {bad[0].status_counts()}")

    def stats(xs):
        xs = sorted(xs)
        if not xs:
            return {"calls": 0}
        return {"calls": len(xs), "median_us": xs[len(xs) // 2] / 1e3,
                "p99_us": xs[min(len(xs) - 1, int(len(xs) * 0.99))] / 1e3, "max_us": xs[-1] / 1e3}
    return {"all": stats(empty + full), "empty": stats(empty), "drained": stats(full),
            "ops_in_flight": n_ops, "pages_per_op": per, "rounds": rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024, 4096],
                   help="completions drained by one poll()")
    p.add_argument("--ops-per-drain", type=int, default=4, help="ops those completions belong to")
    p.add_argument("--workers", type=int, default=2, help="I/O worker processes")
    p.add_argument("--repeats", type=int, default=3, help="median of this many drains per cell")
    p.add_argument("--in-flight", type=int, default=0, metavar="N",
                   help="time every poll() with N ops in flight instead (see above)")
    p.add_argument("--pages", type=int, default=768, help="--in-flight: pages in the store")
    p.add_argument("--page-kib", type=int, default=256, help="--in-flight: KiB per page")
    p.add_argument("--rounds", type=int, default=5, help="--in-flight: rounds of N ops")
    p.add_argument("--json", default=None, help="--in-flight: write the figures here")
    args = p.parse_args(argv)
    if args.in_flight:
        return main_in_flight(args)
    top = max(args.sizes)
    g = PageGeometry(num_layers=2, num_kv_heads=1, head_dim=64, page_size=16, layout="page_first")
    with tempfile.TemporaryDirectory() as store, PrefetchEngine(EngineConfig(
            storage_dir=store, num_workers=args.workers, host_pool_pages=top), g) as eng:
        keys = [f"page-{i}" for i in range(top)]
        op = eng.backup(keys, range(top))
        if not eng.wait(op, 60) or op.status != "ok":
            raise SystemExit(f"writing the pages failed: {op.status_counts()}")
        default = engine_mod.BATCH_APPLY_MIN
        print(f"poll() cost per drained completion, {args.workers} workers, {g.page_bytes} B "
              f"pages, {args.ops_per_drain} ops per drain, median of {args.repeats}; "
              f"bulk from {default} pages of one op up")
        print(f"{'drained':>8} {'engine us':>10} {'bulk us':>9} {'per-page us':>12} "
              f"{'per-page/engine':>16}")
        for n in args.sizes:
            cells = {}
            for label, threshold in (("engine", default), ("bulk", 1), ("page", 10 ** 9)):
                engine_mod.BATCH_APPLY_MIN = threshold
                try:
                    cells[label] = statistics.median(
                        one_drain(eng, keys[:n], args.ops_per_drain) for _ in range(args.repeats))
                finally:
                    engine_mod.BATCH_APPLY_MIN = default
            print(f"{n:>8} {cells['engine']:>10.2f} {cells['bulk']:>9.2f} {cells['page']:>12.2f} "
                  f"{cells['page'] / cells['engine']:>16.2f}")
    return 0


def main_in_flight(args) -> int:
    # layers x 2 x heads x dim x 2 bytes x page_size: 64 KiB per (layer, 16 tokens) step
    g = PageGeometry(num_layers=max(1, args.page_kib // 64), num_kv_heads=8, head_dim=128,
                     page_size=16, layout="page_first")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_POLL_DIR")) as store, \
            PrefetchEngine(EngineConfig(storage_dir=store, num_workers=args.workers,
                                        host_pool_pages=args.pages), g) as eng:
        keys = [f"page-{i}" for i in range(args.pages)]
        for i in range(0, args.pages, 256):   # the pool's bytes, written 256 pages a time
            op = eng.backup(keys[i:i + 256], range(i, min(args.pages, i + 256)))
            if not eng.wait(op, 120) or op.status != "ok":
                raise SystemExit(f"writing the pages failed: {op.status_counts()}")
        in_flight(eng, keys, args.in_flight, 1)        # warm: page cache, first polls
        res = in_flight(eng, keys, args.in_flight, args.rounds)
        res.update(workers=eng.metrics()["workers"], page_bytes=g.page_bytes, pages=args.pages)
    a, e, d = res["all"], res["empty"], res["drained"]
    print(f"poll() with {args.in_flight} ops in flight, {res['workers']} workers, "
          f"{g.page_bytes >> 10} KiB pages, {args.pages} pages x {args.rounds} rounds")
    print(f"{'calls':>14} {'n':>9} {'median µs':>10} {'p99 µs':>8} {'max µs':>8}")
    for name, x in (("all", a), ("drained none", e), ("drained some", d)):
        if x["calls"]:
            print(f"{name:>14} {x['calls']:>9} {x['median_us']:>10.2f} {x['p99_us']:>8.2f} "
                  f"{x['max_us']:>8.1f}")
    print(f"target: median <= 2 µs, p99 <= 20 µs (all calls): median {a['median_us']:.2f}, "
          f"p99 {a['p99_us']:.2f}")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
