#!/usr/bin/env python3
"""The table of scripts/device/device_before_after.sh: per run, the before and
after figures of one benchmark, and after/before of their medians.

Reads DIR/<what>-<before|after>-<n>.json as each bench writes it (--json):
  prefetch  scripts/bench_prefetch.py: ratios.mp_busy_over_idle, and of the
            last worker count in `sweep`, mp_idle.gbps, mp_busy.gbps and
            mp_busy.loop_rate (the busy loop's rate while mp prefetches)
  stack     hicache_mp/bench/sglang/stack.py: summary.mp_busy_over_idle and
            summary.wrong_pages (or, from an older harness, the mp backend's
            busy_over_idle and every backend's wrong_pages)
  vllm      hicache_mp/bench/vllm/tier.py: the busy hicache_mp rows' load GB/s
            and loop rate (load.loop_iters / load.seconds), the loop ratio
            (that rate over the no-I/O rate of the same round), medians over
            the run's repeats, and their wrong bytes
Each figure is read from whichever of the names a tree's bench used; a run
with no JSON (timed out, failed) shows as "-".
Usage: python3 scripts/device/before_after_summary.py DIR prefetch|stack|vllm
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys


def _get(d, *paths):
    """The first of `paths` (dotted) present in `d`; None if none is."""
    for path in paths:
        v = d
        for k in path.split("."):
            if not isinstance(v, dict) or k not in v:
                v = None
                break
            v = v[k]
        if v is not None:
            return v
    return None


def prefetch(d) -> dict:
    sweep = d.get("sweep") or {}
    head = sweep[list(sweep)[-1]] if sweep else {}
    idle, busy = _get(head, "mp_idle.gbps"), _get(head, "mp_busy.gbps")
    ratio = _get(d, "ratios.mp_busy_over_idle")
    if ratio is None and idle and busy is not None:
        ratio = busy / idle
    return {"mp busy/idle": ratio, "mp idle GB/s": idle, "mp busy GB/s": busy,
            "loop it/s (mp busy)": _get(head, "mp_busy.loop_rate", "mp_busy.loop_rate_hz"),
            "workers": list(sweep)[-1] if sweep else None}


def stack(d) -> dict:
    b = {r.get("backend"): r for r in d.get("backends", [])}
    ratio = _get(d, "summary.mp_busy_over_idle")
    if ratio is None:
        ratio = _get(b.get("mp", {}), "busy_over_idle")
    wrong = _get(d, "summary.wrong_pages")
    if wrong is None and b:
        wrong = sum(r.get("wrong_pages", 0) for r in b.values())
    return {"mp busy/idle": ratio, "wrong pages": wrong,
            "checked pages": _get(b.get("mp", {}), "checked_pages")}


def vllm(d) -> dict:
    rows = [r for r in d.get("rows", []) if r.get("tier") == "hicache_mp"
            and r.get("mode") == "busy" and "load" in r]
    med = lambda xs: statistics.median(xs) if xs else None
    gbps = med([r["load"]["gbps"] for r in rows])
    rate = med([r["load"]["loop_iters"] / r["load"]["seconds"] for r in rows
                if r["load"].get("seconds")])
    return {"busy load GB/s": gbps, "loop it/s (busy load)": rate,
            "loop ratio": med([r["loop_ratio"] for r in rows if "loop_ratio" in r]),
            "wrong bytes": sum(r["load"].get("wrong_bytes", 0) for r in rows) if rows else None}


READ = {"prefetch": prefetch, "stack": stack, "vllm": vllm}
# figures whose after/before is shown; the rest are shown per run only
COMPARED = {"prefetch": ["mp busy/idle", "mp idle GB/s", "mp busy GB/s", "loop it/s (mp busy)"],
            "stack": ["mp busy/idle"],
            # the loop ratio is the bench's own "loop" column: the loop's rate in
            # the load phase over its no-I/O rate in the same round, so the box's
            # drift within a call (11.8 -> 10.2 M it/s in one) cancels; the raw
            # it/s carries that drift and is shown beside it
            "vllm": ["busy load GB/s", "loop it/s (busy load)", "loop ratio"]}


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3f}"
    return str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the OUTDIR device_before_after.sh wrote its runs into")
    ap.add_argument("what", choices=sorted(READ), help="which benchmark's runs to read")
    args = ap.parse_args(argv)
    root, what = args.dir, args.what
    runs = {}
    for path in glob.glob(os.path.join(root, f"{what}-*-*.json")):
        m = re.fullmatch(rf"{what}-(before|after)-(\d+)\.json", os.path.basename(path))
        if not m:
            continue
        try:
            with open(path) as f:
                runs[(m[1], int(m[2]))] = READ[what](json.load(f))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            print(f"{path}: unreadable ({exc!r})")
    ns = sorted({n for _, n in runs} | {int(m[1]) for m in (
        re.fullmatch(rf"{what}-(?:before|after)-(\d+)\.log", os.path.basename(p))
        for p in glob.glob(os.path.join(root, f"{what}-*-*.log"))) if m})
    if not ns:
        print(f"{what}: no runs in {root}")
        return 1
    keys = next((list(r) for r in runs.values()), COMPARED[what])
    w = max(len(k) for k in keys) + 2
    print(f"== {what}: before (05859c4) vs after (this tree), {len(ns)} interleaved pair(s),"
          " the order alternating (b a, a b, ...)")
    print(f"{'figure':<{w}}" + "".join(f"{f'b#{n}':>10}{f'a#{n}':>10}" for n in ns)
          + f"{'med b':>10}{'med a':>10}{'a/b':>8}")
    bad = False
    for k in keys:
        line = f"{k:<{w}}"
        vals = {"before": [], "after": []}
        for n in ns:
            for label in ("before", "after"):
                v = runs.get((label, n), {}).get(k)
                line += f"{fmt(v):>10}"
                if isinstance(v, (int, float)):
                    vals[label].append(v)
        if k in COMPARED[what]:
            mb = statistics.median(vals["before"]) if vals["before"] else None
            ma = statistics.median(vals["after"]) if vals["after"] else None
            r = ma / mb if mb and ma is not None else None
            line += f"{fmt(mb):>10}{fmt(ma):>10}{(f'{r:.3f}' if r is not None else '-'):>8}"
            if r is not None and r < 0.97:
                line += "  < 0.97"
        elif k.startswith("wrong") and any(vals[x] and max(vals[x]) for x in vals):
            line += "  WRONG BYTES"
            bad = True
        print(line)
    missing = [f"{label}#{n}" for n in ns for label in ("before", "after") if (label, n) not in runs]
    if missing:
        print("no JSON from: " + ", ".join(missing))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
