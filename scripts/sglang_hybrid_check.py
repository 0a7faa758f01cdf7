#!/usr/bin/env python3
"""Hybrid models (Mamba, SWA, DSA indexer) through SGLang's real hybrid controller and pools: bytes, rounds, GIL hand-offs.

The harness is `hicache_mp.bench.sglang.hybrid_check` (its docstring says what it measures and how); this
script runs it as its user would, with the same flags:

    python3 scripts/sglang_hybrid_check.py --help
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("hicache_mp.bench.sglang.hybrid_check", run_name="__main__")
