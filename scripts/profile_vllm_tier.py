#!/usr/bin/env python3
"""profile_vllm_tier: where vLLM's scheduler thread goes during this tier's loads.

Runs bench_vllm_tier's busy warm row for hicache_mp only, --rounds times: a
store, then a load, of --rows rows, the pure-Python busy loop between steps.
Per load phase it prints GB/s, the milliseconds vLLM's scheduler thread
spent inside the tier's calls (submits included), their share of the phase,
the loop's rate against its rate with no I/O, and the spin's rate, then the
medians. --profile adds a cProfile of the tier's calls alone. --tree DIR
takes hicache_mp and the bench from another checkout (e.g. a `git archive`
of an older commit), so two trees can be timed in one session on one
machine, interleaved.

    python scripts/profile_vllm_tier.py --rows 1024 --rounds 5
    python scripts/profile_vllm_tier.py --tree /tmp/old --rounds 5 --profile
"""
import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=1024, help="rows per phase")
    p.add_argument("--row-bytes", type=int, default=2 << 20)
    p.add_argument("--workers", type=int, default=0, help="0: auto")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="the checkout whose hicache_mp and scripts/bench_vllm_tier.py run")
    p.add_argument("--profile", action="store_true", help="cProfile the tier's calls")
    args = p.parse_args(argv)
    sys.path[:0] = [os.path.join(args.tree, "scripts"), args.tree]
    import numpy as np

    import bench_vllm_tier as bench
    import hicache_mp.integrations.vllm as tier_mod
    print(f"hicache_mp from {os.path.dirname(tier_mod.__file__)}", flush=True)
    bargs = bench.parse_args(["--rows", str(args.rows), "--row-bytes", str(args.row_bytes),
                              "--workers", str(args.workers)])
    rig = bench.Rig(bargs.row_bytes, 2 * bargs.rows)
    rig.view[:bargs.rows] = np.random.default_rng(0).integers(
        0, 256, (bargs.rows, bargs.row_bytes), dtype=np.uint8)
    prof = cProfile.Profile() if args.profile else None
    if prof:
        plain = bench.Clock.call

        def profiled(self, fn, *a):
            prof.enable()
            try:
                return plain(self, fn, *a)
            finally:
                prof.disable()
        bench.Clock.call = profiled
    root = tempfile.mkdtemp(prefix="profile_vllm_tier.")
    rows, wrong = [], 0
    try:
        for i in range(args.rounds):
            r = bench.tier_row(rig, bargs, "hicache_mp", "hicache_mp", os.path.join(root, f"r{i}"),
                               threads=0, direct=False, busy=True, run_id=i + 1, baseline_s=0.3)
            ld = r["load"]
            wrong += ld["wrong_bytes"]
            rows.append((ld["gbps"], ld["tier_calls_s"] * 1e3, ld["call_share"], r["loop_ratio"],
                         r["spin_ratio"]))
            print("load %.2f GB/s, calls %.1f ms (share %.3f), loop %.2f, spin %.2f, "
                  "%d workers, wrong bytes %d" % (*rows[-1], r["threads"], ld["wrong_bytes"]),
                  flush=True)
    finally:
        rig.close()
        shutil.rmtree(root, ignore_errors=True)
    med = [statistics.median(x[j] for x in rows) for j in range(5)]
    print("median of %d: load %.2f GB/s, calls %.1f ms (share %.3f), loop %.2f, spin %.2f"
          % (len(rows), *med))
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
