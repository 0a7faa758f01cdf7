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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024, 4096],
                   help="completions drained by one poll()")
    p.add_argument("--ops-per-drain", type=int, default=4, help="ops those completions belong to")
    p.add_argument("--workers", type=int, default=2, help="I/O worker processes")
    p.add_argument("--repeats", type=int, default=3, help="median of this many drains per cell")
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
