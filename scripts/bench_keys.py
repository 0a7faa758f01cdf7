#!/usr/bin/env python3
"""What the scheduler's thread pays per key: `exists()` and `present()` with key
digests remembered (workers.naming) against computed on every call, same run.

  exists   exists() of 16 keys (a third of them new each call, as a scheduler
           asking about a prefix another engine is writing) plus poll()
  present  present() of 128 keys (what batch_set_v1 asks before a backup)

"computed" empties the digest memory before every call, which is what every
call paid before digests were remembered. Prints medians of --repeats and the
ratio.

    PYTHONPATH=. python3 scripts/bench_keys.py
"""
import argparse
import os
import statistics
import sys
import tempfile
import time


from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from workers import naming

GEOMETRY = dict(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16",
                layout="page_first")


def per_call_us(fn, calls: int, forget: bool) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        if forget:
            naming._DIGESTS.clear()
        fn(i)
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_keys.") as d, \
            PrefetchEngine(EngineConfig(storage_dir=d, num_workers=1, host_pool_pages=32),
                           PageGeometry(**GEOMETRY)) as e:
        keys128 = [f"p{j}" for j in range(128)]

        def ask(i):
            e.exists([f"k{i // 3 + j}" for j in range(16)])
            e.poll()

        cases = {"exists(16) + poll": (ask, args.calls),
                 "present(128)": (lambda i: e.present(keys128), args.calls // 10)}
        for name, (fn, calls) in cases.items():
            got = {"remembered": [], "computed": []}
            for _ in range(args.repeats):  # interleaved: the box's drift hits both
                for mode in got:
                    got[mode].append(per_call_us(fn, calls, mode == "computed"))
            rem, comp = (statistics.median(got[m]) for m in ("remembered", "computed"))
            print(f"{name:18s} remembered {rem:7.1f} us   computed {comp:7.1f} us   "
                  f"computed / remembered {comp / rem:.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
