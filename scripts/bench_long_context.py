#!/usr/bin/env python
"""Full-scale reference workload (docs/design.md §5): Llama-3.1-8B, 8 MiB pages.

The same code path as `hicache-mp bench` (this calls its entry point with the
arguments given; without --quick that is full scale: 32 layers x 8 KV heads x
128 dims, bf16, 32 requests of mean 19.7k tokens, 85.6 % cached). The store
for all 32 requests needs ~82 GB of disk; `--num-requests N` fits a smaller
one. Must not hold benchmark logic: it lives in hicache_mp.bench.sim.

    python scripts/bench_long_context.py --num-requests 20 --json full.json
    python scripts/bench_long_context.py --help      # every flag, with defaults

All six runs in one table, split over calls of a few minutes each (a 64 GB
disk holds 20 requests: 44 GB of store plus one run's 7 GB of write-backs,
removed after each run). Every call reuses the warm store in --storage-dir;
--merge then prints one comparison table and verdict from the JSON reports:

    B="python3 scripts/bench_long_context.py --num-requests 20 --storage-dir /tmp/lc --hicache-mp-direct-io off"
    J=/tmp/lc_json; mkdir -p $J
    $B --hicache-storage-backend none --json $J/1.json && $B --hicache-storage-backend mp --json $J/6.json \
      && $B --hicache-storage-backend file --scheduler-yield-ms 1 --json $J/3.json   # call 1 (+ warm-up)
    $B --hicache-storage-backend file --json $J/2.json                                # call 2
    $B --hicache-storage-backend fast_file --json $J/4.json                           # call 3 (1 read thread)
    $B --hicache-storage-backend fast_file --fast-file-read-workers 4 --json $J/5.json  # call 4
    python3 scripts/bench_long_context.py --merge $J/[1-6].json --json $J/all.json
"""
import sys

from hicache_mp.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
