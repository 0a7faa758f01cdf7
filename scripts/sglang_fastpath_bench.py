#!/usr/bin/env python3
"""SGLang's stock storage path against hicache_mp's fast path, interleaved in one run
(sleeping floor, mp and file; dense and hybrid; idle and busy scheduler).

The bench is `hicache_mp.bench.sglang.fastpath_bench` (its docstring says what it measures and
how); this script runs it as its user would, with the same flags:

    python3 scripts/sglang_fastpath_bench.py --help
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("hicache_mp.bench.sglang.fastpath_bench", run_name="__main__")
