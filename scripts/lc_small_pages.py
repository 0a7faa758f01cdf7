#!/usr/bin/env python
"""The long-context workload at full scale with fewer layers: a small box's analogue.

Every request, prompt, cached prefix (page counts), arrival and compute time
is the full-scale one of scripts/bench_long_context.py; only the pages are
smaller (--layers of Llama-3.1-8B's 32: 2 layers = 512 KiB pages, a 2.8 GB
store for 20 requests), so the store stays in a 2-core box's page cache as
the full one does on the H200 box. Prints each run's summary (with where the
GPU waited, decision 82) and the comparison. Must not hold benchmark logic:
hicache_mp.bench.sim runs it.

    python3 scripts/lc_small_pages.py --num-requests 20 --storage-dir /tmp/lc2
    python3 scripts/lc_small_pages.py --runs mp --hicache-mp-direct-io off
"""
import argparse
import sys

from hicache_mp.bench.sim.bench import Bench, BenchConfig, table_rows
from hicache_mp.bench.sim.summary import format_comparison, format_summary, format_verdict


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", default="none,mp", help="comma-separated run labels")
    p.add_argument("--num-requests", type=int, default=20, help="requests in the workload")
    p.add_argument("--layers", type=int, default=2, help="layers per page (full scale: 32)")
    p.add_argument("--storage-dir", default=None, help="page store (default: a temp dir)")
    p.add_argument("--hicache-mp-direct-io", default="auto", choices=("auto", "on", "off"),
                   help="O_DIRECT page I/O")
    p.add_argument("--device-load", default="auto", choices=("auto", "on", "off"),
                   help="load prefetched pages to a device KV cache")
    a = p.parse_args(argv)
    bench = Bench(BenchConfig(runs=tuple(a.runs.split(",")), num_requests=a.num_requests,
                              storage_dir=a.storage_dir, geometry={"num_layers": a.layers},
                              device_load=a.device_load,
                              engine_options={"direct_io": a.hicache_mp_direct_io}))
    report = bench.run(on_result=lambda label, res, figs: print(
        format_summary(label, figs["summary"], figs["extra"]), flush=True))
    rows = table_rows(report["runs"])
    base = "none" if "none" in rows else next(iter(rows))
    print(format_comparison(rows, baseline=base))
    verdict = format_verdict(rows)
    if verdict:
        print(verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
