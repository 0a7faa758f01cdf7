"""Benchmark code, apart from the engine: the baselines `mp` is measured against and the reference engine.

Owns the in-process baselines (`file`: baseline.ThreadedFileEngine, SGLang's
HiCacheFile; `fast_file`: fast_file.FastFileEngine, SGLang PR #39880) with
their shared threads (inprocess) and by-path directory making (storedir), and
the reference engine (`sim/`: a scheduler modelled on SGLang's, its workload,
the `hicache-mp bench` runs and their summary); and the harness that scripts
and tests share: the busy scheduler loop (loop), the GIL tracer (giltrace),
and the rigs that drive SGLang's and vLLM's real classes (sglang/, vllm/).
scripts/ holds only their command lines. Must not be imported by the
engine: nothing under hicache_mp, workers or shm outside this package imports
it, except `hicache_mp.make_engine` (the baselines, on request) and the CLI.
"""
