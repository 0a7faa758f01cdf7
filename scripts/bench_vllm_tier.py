#!/usr/bin/env python3
"""vLLM's own fs tier against hicache_mp's, through vLLM's classes, in one run.

The harness is `hicache_mp.bench.vllm.tier` (its docstring says what it measures and how); this
script runs it as its user would, with the same flags:

    python3 scripts/bench_vllm_tier.py --help
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("hicache_mp.bench.vllm.tier", run_name="__main__")
