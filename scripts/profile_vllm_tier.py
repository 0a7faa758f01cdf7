#!/usr/bin/env python3
"""profile_vllm_tier: where vLLM's scheduler thread goes during this tier's loads.

Runs bench_vllm_tier's busy warm row for hicache_mp only, --rounds times: a
store, then a load, of --rows rows, the pure-Python busy loop between steps.
Per load phase it prints GB/s, the milliseconds vLLM's scheduler thread
spent inside the tier's calls (submits included), their share of the phase,
the loop's rate against its rate with no I/O, and the spin's rate, then the
medians. --profile adds a cProfile of the tier's calls alone, --breakdown
their time by kind of call. --tree DIR
takes hicache_mp and the bench from another checkout (e.g. a `git archive`
of an older commit), so two trees can be timed in one session on one
machine, interleaved.

    python scripts/profile_vllm_tier.py --rows 1024 --rounds 5
    python scripts/profile_vllm_tier.py --tree /tmp/old --rounds 5 --profile
"""
import argparse
import cProfile
import importlib.util
import os
import pstats
import shutil
import statistics
import sys
import tempfile


TREE_ENV = "HICACHE_MP_PROFILE_TREE"  # set in the re-executed interpreter of --tree


def _bench_module(tree):
    """The vLLM tier bench: the package's, or, in a tree older than the package's
    bench harness, its scripts/bench_vllm_tier.py (loaded from its file)."""
    try:
        from hicache_mp.bench.vllm import tier
        return tier
    except ImportError:
        if not tree:
            raise
    spec = importlib.util.spec_from_file_location(
        "bench_vllm_tier", os.path.join(tree, "scripts", "bench_vllm_tier.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=1024, help="rows per phase")
    p.add_argument("--row-bytes", type=int, default=2 << 20)
    p.add_argument("--workers", type=int, default=0, help="0: auto")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tree", default=None,
                   help="another checkout whose hicache_mp and vLLM tier bench run (default: "
                        "the installed hicache_mp)")
    p.add_argument("--profile", action="store_true", help="cProfile the tier's calls")
    p.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"],
                   help="--profile's order")
    p.add_argument("--breakdown", action="store_true",
                   help="per store and load phase: calls and ms by kind (submits, the first "
                        "poll, which starts the step's ops, polls that skipped, drained or "
                        "reported jobs, step ends), with each kind's median, p90 and max")
    args = p.parse_args(argv)
    if args.tree and os.environ.get(TREE_ENV) != args.tree:
        # The other tree goes first on PYTHONPATH of a fresh interpreter: this one
        # may have imported a hicache_mp already, and two cannot share one process.
        env = dict(os.environ, **{TREE_ENV: args.tree, "PYTHONPATH": os.pathsep.join(
            [args.tree, *filter(None, [os.environ.get("PYTHONPATH")])])})
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    import numpy as np

    import hicache_mp.integrations.vllm as tier_mod
    bench = _bench_module(args.tree)
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
    kinds: dict = {}
    phase = ["store", False]
    if args.breakdown:
        timed, moved = bench.Clock.call, bench.move

        def move(tier, rig, bargs, keys, src, dst, busy, load, first_id):
            phase[:] = ["load" if load else "store", True]  # whose the calls are
            return moved(tier, rig, bargs, keys, src, dst, busy, load, first_id)
        bench.move = move

        def lazy_skips(eng) -> int:
            return eng.metrics()["lazy_polls_skipped"] if eng is not None else 0

        def bucketed(self, fn, *a):
            name = getattr(fn, "__name__", "?")
            eng = getattr(getattr(fn, "__self__", None), "engine", None)
            skips = lazy_skips(eng)
            before = self.calls_s
            out = timed(self, fn, *a)
            dt = self.calls_s - before
            if name == "get_finished_jobs" and phase[1]:
                name, phase[1] = "first poll (op start)", False
            elif name == "get_finished_jobs":
                name = ("poll reported" if out else "poll skipped"
                        if lazy_skips(eng) > skips else "poll drained")
            kinds.setdefault(f"{phase[0]}: {name}", []).append(dt)
            return out
        bench.Clock.call = bucketed
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
    if kinds:
        print(f"per phase ({len(rows)} of each), by kind of call (the first poll of a phase "
              f"starts its op):")
        phases = len(rows)
        print(f"  {'kind':<30}{'calls':>7}{'ms':>8}{'us median':>11}{'p90':>8}{'max':>8}")
        for name, ts in sorted(kinds.items(), key=lambda kv: (kv[0][0], -sum(kv[1]))):
            ts = sorted(ts)
            print(f"  {name:<30}{len(ts) / phases:7.1f}{sum(ts) * 1e3 / phases:8.2f}"
                  f"{ts[len(ts) // 2] * 1e6:11.1f}{ts[len(ts) * 9 // 10] * 1e6:8.1f}"
                  f"{ts[-1] * 1e6:8.0f}")
    if prof:
        pstats.Stats(prof).sort_stats(args.sort).print_stats(20)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
