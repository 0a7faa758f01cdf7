#!/usr/bin/env python3
"""hicache_mp's vLLM tier at its store's capacity limit, through vLLM's real tiering classes.

The harness is `hicache_mp.bench.vllm.capacity` (its docstring says what it measures and how); this
script runs it as its user would, with the same flags:

    python3 scripts/bench_vllm_capacity.py --help
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("hicache_mp.bench.vllm.capacity", run_name="__main__")
