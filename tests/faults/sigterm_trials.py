#!/usr/bin/env python3
"""SIGTERM trials (issue 23's done-when): a server is stopped many times by another process.

Equipment of the fault suite, not a test (pytest does not collect it) and not a
user's script: it drives tests/faults/sigterm_kit.py's server many times over.

Each trial starts a server process (tests/faults/sigterm_kit.py: a real
engine, real workers, a real store; a loop that fills, backs up, prefetches,
polls and waits) and sends it SIGTERM at a random point aimed at one phase:
inside wait(), inside poll(), inside backup(), or between calls. Its handler
closes the engine and exits (os._exit, raise SystemExit, sys.exit) or only
closes (the loop must then see EngineClosed, and runs its next round on a new
engine). Prints, per handler and phase: where the signals landed, how long
the server took to stop (and how many stopped within 1 s plus the flush
close() reported), exceptions other than EngineClosed that escaped, lost or
wrong pages, and segments or processes left behind.

    python3 tests/faults/sigterm_trials.py --trials 200
    python3 tests/faults/sigterm_trials.py --trials 40 --handlers close --json out.json
"""
import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time

import sigterm_kit as kit  # this file's neighbour: python puts tests/faults/ first on the path

BOUND_S = 1.0  # the done-when: stopped within a second, plus the flush it reported


def run(trials: int, handlers, targets, rounds: int, workers: int, root: str) -> list:
    """About `trials` SIGTERMs spread evenly over handler x phase."""
    variants = [(h, t) for h in handlers for t in targets]
    per = max(1, -(-trials // len(variants)))
    results, seed = [], 0
    for h, t in variants:
        left = per
        while left > 0:
            n = min(left, rounds) if h == "close" else 1
            seed += 1
            results += kit.trial(root, h, t, rounds=n, workers=workers, seed=seed)
            left -= n
    return results


def summarize(results: list) -> dict:
    out = {}
    by = collections.defaultdict(list)
    for r in results:
        by[(r["handler"], r["target"])].append(r)
    for (h, t), rs in by.items():
        stops = sorted(r["stop_s"] for r in rs if r["stop_s"] is not None)
        within = sum(1 for r in rs if r["stop_s"] is not None and
                     r["stop_s"] <= BOUND_S + r.get("flush_s", 0.0))
        landed = collections.Counter(r.get("landed", {}).get("api", "?") for r in rs)
        out[f"{h}/{t}"] = {
            "trials": len(rs),
            "landed": dict(landed.most_common()),
            "stop_p50_s": stops[len(stops) // 2] if stops else None,
            "stop_max_s": stops[-1] if stops else None,
            "within_1s_plus_flush": within,
            "flush_max_s": max((r.get("flush_s", 0.0) for r in rs), default=0.0),
            "flush_cut": sum(1 for r in rs if r.get("report", {}).get("why")),
            "escaped": sum(1 for r in rs if r["escaped"]),
            "lost_pages": sum(r["lost"] for r in rs),
            "wrong_pages": sum(r.get("round", {}).get("wrong", 0) for r in rs),
            "shm_left": sum(len(r["shm_left"]) for r in rs),
            "procs_left": sum(len(r["procs_left"]) for r in rs),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200, help="SIGTERMs in all (default 200)")
    ap.add_argument("--handlers", default=",".join(kit.HANDLERS),
                    help=f"comma-separated, of {','.join(kit.HANDLERS)}")
    ap.add_argument("--targets", default=",".join(kit.TARGETS),
                    help=f"phases aimed at, of {','.join(kit.TARGETS)}")
    ap.add_argument("--rounds", type=int, default=5,
                    help="SIGTERMs per server process with the close-only handler")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", help="write every trial's result here")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="hicache_mp-sigterm-")
    t0 = time.monotonic()
    try:
        results = run(a.trials, a.handlers.split(","), a.targets.split(","), a.rounds,
                      a.workers, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = summarize(results)
    cols = ("trials", "within_1s_plus_flush", "stop_p50_s", "stop_max_s", "flush_max_s",
            "flush_cut", "escaped", "lost_pages", "wrong_pages", "shm_left", "procs_left")
    print(f"{'variant':<18}" + "".join(f"{c:>22}" for c in cols) + "  landed in")
    for name, row in table.items():
        print(f"{name:<18}" + "".join(f"{str(row[c]):>22}" for c in cols) + "  " +
              ", ".join(f"{k} {v}" for k, v in row["landed"].items()))
    bad = [r for r in results if r["escaped"]]
    for r in bad[:10]:
        print(f"\nESCAPED ({r['handler']}/{r['target']}, landed {r.get('landed')}):")
        for e in r["escaped"]:
            print("  " + e.replace("\n", "\n  "))
    total = {k: sum(row[k] for row in table.values()) for k in
             ("trials", "within_1s_plus_flush", "escaped", "lost_pages", "wrong_pages",
              "shm_left", "procs_left")}
    print(f"\nall: {total} in {time.monotonic() - t0:.0f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": table, "results": results}, f, indent=1)
    ok = total["within_1s_plus_flush"] == total["trials"] and not any(
        total[k] for k in ("escaped", "lost_pages", "wrong_pages", "shm_left", "procs_left"))
    print("verdict: " + ("every stop within 1 s plus its flush, nothing escaped, lost or left"
                         if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
