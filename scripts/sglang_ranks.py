#!/usr/bin/env python3
"""Several SGLang ranks on one node, each its own process through SGLang's real stack, concurrently.

The harness is `hicache_mp.bench.sglang.ranks` (its docstring says what it measures and how); this
script runs it as its user would, with the same flags:

    python3 scripts/sglang_ranks.py --help
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("hicache_mp.bench.sglang.ranks", run_name="__main__")
