#!/usr/bin/env python3
"""Real-stack harness: hicache_mp behind SGLang's own HiCacheController, idle and busy scheduler.

The harness is `hicache_mp.bench.sglang.stack` (its docstring says what it measures and how); this
script runs it as its user would, with the same flags:

    python3 scripts/sglang_stack.py --help
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("hicache_mp.bench.sglang.stack", run_name="__main__")
