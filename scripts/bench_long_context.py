#!/usr/bin/env python
"""Full-scale long-context benchmark of shared/WORKLOAD.md: Llama-3.1-8B, 8 MiB pages.

The same code path as `hicache-mp bench` (this calls its entry point with the
arguments given; without --quick that is full scale: 32 layers x 8 KV heads x
128 dims, bf16, 32 requests of mean 19.7k tokens, 85.6 % cached). The store
for all 32 requests needs ~82 GB of disk; `--num-requests N` fits a smaller
one. Must not hold benchmark logic: it lives in hicache_mp.sim.

    python scripts/bench_long_context.py --num-requests 20 --json full.json
    python scripts/bench_long_context.py --help      # every flag, with defaults
"""
import sys

from hicache_mp.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
