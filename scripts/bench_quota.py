"""The engine in a container's CPU limit: auto against fixed worker counts, from one run.

A pure-Python scheduler loop calls poll() every step beside an engine that
prefetches a warm store (1 GiB of Llama-3.1-8B pages by default) without pause,
for --seconds, in a child process placed, before it runs, in:
  quota:N     a child cgroup with a CPU quota of N CPUs (cgroup v2 cpu.max or v1
              cfs_quota_us; needs root and a writable CPU controller), or
  affinity:N  an affinity mask of N CPUs (taskset's way, a cpuset's effect), or
  none        neither.
For each limit it runs auto (num_workers=0) and a sweep of fixed counts,
interleaved over --repeats rounds, and prints per case: GB/s, loop steps/s,
gaps between steps over 10 ms, the longest gap, the cgroup's throttle counters
(read by the bench from the cgroup it made, and by the engine: metrics()["cpu"]),
and the bytes checked, with the ratio of auto to the best fixed count that had
no such gap, all from the same run. Every op's status is checked, a sampled
page per op while the loop runs, and every byte of the pool at the end.

  sudo python3 scripts/bench_quota.py --limits quota:4 quota:8 affinity:4 none --dir /tmp
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

GAP_S = 0.010
OP_PAGES = 16


def log(msg: str) -> None:
    print(f"[bench_quota {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def geometry(args):
    from hicache_mp import PageGeometry
    return PageGeometry(args.num_layers, 8, 128, args.page_size, "bfloat16", "page_first")


def page_content(i: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, nbytes, dtype=np.uint8)


def pool_bytes(eng, pages: int) -> np.ndarray:
    """The host pool as (pages, page bytes) of uint8, no copy (page_first layout)."""
    import torch
    return eng.host_pool.tensor.view(-1).view(torch.uint8).numpy().reshape(pages, -1)


def write_store(args, store: str) -> None:
    """args.pages pages of distinct random bytes, through an engine's backup."""
    from hicache_mp import EngineConfig, make_engine
    geo = geometry(args)
    cfg = EngineConfig(storage_dir=store, num_workers=2, host_pool_pages=args.pages,
                       model_name="bench-quota")
    with make_engine("mp", cfg, geo) as eng:
        pool = pool_bytes(eng, args.pages)
        for i in range(args.pages):
            pool[i] = page_content(i, geo.page_bytes)
        op = eng.backup([f"q-{i}" for i in range(args.pages)], range(args.pages))
        eng.wait(op)
        if op.status != "ok":
            raise RuntimeError(f"could not write the store: {op.status_counts()}")
    for root, _, files in os.walk(store):  # warm the page cache: the load is a copy
        for name in files:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while f.read(1 << 22):
                    pass


# --- the child: one case -------------------------------------------------------------
def child(args) -> dict:
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from hicache_mp import EngineConfig, make_engine
    from hicache_mp.bench.loop import scheduler_step
    geo = geometry(args)
    n = args.pages
    expected = np.stack([page_content(i, geo.page_bytes) for i in range(n)])
    keys = [f"q-{i}" for i in range(n)]
    cfg = EngineConfig(storage_dir=args.store, num_workers=args.workers, host_pool_pages=n,
                       model_name="bench-quota")
    rng = np.random.default_rng(7)
    t_start = time.perf_counter()
    with make_engine("mp", cfg, geo) as eng:
        started_s = time.perf_counter() - t_start
        pool = pool_bytes(eng, n)
        groups = [(keys[i:i + OP_PAGES], np.arange(i, min(n, i + OP_PAGES)))
                  for i in range(0, n, OP_PAGES)]
        ops = [eng.prefetch(k, s) for k, s in groups]
        landed = steps = gaps = 0
        longest = 0.0
        sampled = wrong = 0
        bad_status = {}
        t0 = prev = time.perf_counter()
        deadline = t0 + args.seconds
        while True:
            scheduler_step(eng)
            steps += 1
            now = time.perf_counter()
            gap = now - prev
            prev = now
            if gap > GAP_S:
                gaps += 1
            longest = max(longest, gap)
            if now >= deadline:
                break
            for j, op in enumerate(ops):
                if not op.done:
                    continue
                if op.status != "ok":
                    bad_status[op.status] = bad_status.get(op.status, 0) + 1
                landed += op.completed_pages
                # one sampled 64 KiB run of one page of the op: microseconds, not a gap
                slot = int(groups[j][1][rng.integers(len(groups[j][1]))])
                off = int(rng.integers(0, geo.page_bytes - 65536))
                sampled += 65536
                wrong += int(np.count_nonzero(pool[slot, off:off + 65536] !=
                                              expected[slot, off:off + 65536]))
                ops[j] = eng.prefetch(*groups[j])
        elapsed = time.perf_counter() - t0
        for op in ops:
            eng.wait(op, 60)
            if op.status != "ok":
                bad_status[op.status] = bad_status.get(op.status, 0) + 1
        wrong += int(np.count_nonzero(pool != expected))
        checked = sampled + expected.nbytes
        m = eng.metrics()
    return {"workers": m["workers"], "gbps": landed * geo.page_bytes / elapsed / 1e9,
            "steps_per_s": steps / elapsed, "gaps_over_10ms": gaps, "longest_gap_ms": longest * 1e3,
            "wrong_bytes": wrong, "bytes_checked": checked, "bad_status": bad_status,
            "cpu": m["cpu"], "start_s": started_s}


# --- the parent: limits, cases, table -----------------------------------------------
def run_case(args, limit: str, workers: int) -> dict:
    kind, _, n = limit.partition(":")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--workers", str(workers),
           "--store", args.store, "--pages", str(args.pages), "--seconds", str(args.seconds),
           "--num-layers", str(args.num_layers), "--page-size", str(args.page_size)]
    cg = None
    pre = None
    if kind == "quota":
        from hicache_mp.bench.cgroups import QuotaCgroup
        cg = QuotaCgroup(float(n))
        pre = cg.enter
    elif kind == "affinity":
        cpus = set(sorted(os.sched_getaffinity(0))[:int(n)])
        pre = lambda: os.sched_setaffinity(0, cpus)  # noqa: E731
    try:
        before = cg.stat() if cg else {}
        p = subprocess.run(cmd, preexec_fn=pre, capture_output=True, text=True,
                           timeout=args.seconds + 180)
        after = cg.stat() if cg else {}
    finally:
        if cg:
            cg.close()
    if p.returncode != 0:
        raise RuntimeError(f"{limit} workers={workers}: child failed\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["warnings"] = [line for line in p.stderr.splitlines() if "hicache_mp:" in line]
    if cg:
        res["cgroup_throttled"] = after.get("throttled", 0) - before.get("throttled", 0)
        res["cgroup_periods"] = after.get("periods", 0) - before.get("periods", 0)
        res["cgroup_throttled_ms"] = after.get("throttled_ms", 0) - before.get("throttled_ms", 0)
    return res


def sweep_for(limit: str, given) -> list:
    if given:
        return [int(w) for w in given]
    kind, _, n = limit.partition(":")
    if kind == "none":
        return [14]
    c = int(float(n))
    return sorted({max(1, c - 2), max(1, c - 1), c, 14})


def median_case(runs: list) -> dict:
    out = dict(runs[len(runs) // 2])
    for k in ("gbps", "steps_per_s", "gaps_over_10ms", "longest_gap_ms", "cgroup_throttled",
              "cgroup_throttled_ms"):
        vals = [r[k] for r in runs if k in r]
        if vals:
            out[k] = statistics.median(vals)
            out[k + "_runs"] = vals
    out["wrong_bytes"] = sum(r["wrong_bytes"] for r in runs)
    out["bytes_checked"] = sum(r["bytes_checked"] for r in runs)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limits", nargs="+", default=["quota:4", "quota:8", "affinity:4", "none"],
                    help="quota:N (cgroup CPU quota), affinity:N (CPU mask), none (default: all four)")
    ap.add_argument("--workers", nargs="+", default=None,
                    help="fixed counts to sweep beside auto (default: N-2..N and 14 for a limit of N; "
                         "14 for none)")
    ap.add_argument("--seconds", type=float, default=8.0, help="non-stop prefetch per case (default 8)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians shown (default 1)")
    ap.add_argument("--pages", type=int, default=128, help="pages in the store (default 128: 1 GiB at 8 MiB)")
    ap.add_argument("--num-layers", type=int, default=32, help="Llama-3.1-8B: 32 (default)")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64: 8 MiB pages)")
    ap.add_argument("--dir", default=None, help="where the store goes (default: a temp dir, removed after)")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.workers = int(args.workers[0])
        print(json.dumps(child(args)), flush=True)
        return {}
    base = tempfile.mkdtemp(prefix="hicache_mp_quota_", dir=args.dir)
    args.store = os.path.join(base, "store")
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
           "seconds": args.seconds, "pages": args.pages, "limits": {}}
    try:
        log(f"writing and warming {args.pages} pages in {args.store}")
        write_store(args, args.store)
        cases = [(lim, w) for lim in args.limits for w in [0] + sweep_for(lim, args.workers)]
        runs = {c: [] for c in cases}
        for r in range(args.repeats):
            # each round starts a limit's cases one later, so auto is not always
            # first (the first case of a limit read 3-12% slower on the H200)
            order = []
            for lim in args.limits:
                mine = [c for c in cases if c[0] == lim]
                order += mine[r % len(mine):] + mine[:r % len(mine)]
            for lim, w in order:
                res = run_case(args, lim, w)
                runs[(lim, w)].append(res)
                log(f"round {r + 1} {lim:<11} {'auto' if w == 0 else w:>4} -> {res['workers']:>2} workers "
                    f"{res['gbps']:6.2f} GB/s {res['steps_per_s']:9.0f} steps/s gaps {res['gaps_over_10ms']:>3} "
                    f"longest {res['longest_gap_ms']:6.1f} ms throttled {res.get('cgroup_throttled', '-')}")
        for lim in args.limits:
            rows = {("auto" if w == 0 else str(w)): median_case(runs[(l2, w)])
                    for (l2, w) in cases if l2 == lim}
            out["limits"][lim] = rows
        print_report(out)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return out


def print_report(out: dict) -> None:
    print(f"\n== bench_quota {out['date']}, {out['cpus']} CPUs, {out['pages']} pages, "
          f"{out['seconds']:g} s per case ==")
    print(f"{'limit':<11} {'workers':>9} {'GB/s':>6} {'steps/s':>9} {'gaps>10ms':>9} {'longest ms':>10} "
          f"{'throttled':>13} {'thr. ms':>8} {'engine thr.':>11} {'wrong':>6} {'GB checked':>10}")
    for lim, rows in out["limits"].items():
        for name, r in rows.items():
            thr = (f"{r['cgroup_throttled']:g}/{r['cgroup_periods']}" if "cgroup_throttled" in r else "-")
            thr_ms = f"{r['cgroup_throttled_ms']:.0f}" if "cgroup_throttled_ms" in r else "-"
            label = f"auto={r['workers']}" if name == "auto" else name
            print(f"{lim:<11} {label:>9} {r['gbps']:>6.2f} {r['steps_per_s']:>9.0f} {r['gaps_over_10ms']:>9g} "
                  f"{r['longest_gap_ms']:>10.1f} {thr:>13} {thr_ms:>8} {r['cpu']['throttle']['throttled']:>11} "
                  f"{r['wrong_bytes']:>6} "
                  f"{r['bytes_checked'] / 1e9:>10.1f}")
        auto = rows["auto"]
        clean = [r for n, r in rows.items() if n != "auto" and r["gaps_over_10ms"] == 0]
        best = max(clean, key=lambda r: r["gbps"]) if clean else None
        ratio = f"{auto['gbps'] / best['gbps']:.2f} of {best['workers']} workers' GB/s" if best else \
            "no fixed count without gaps"
        print(f"{lim:<11} auto: {auto['workers']} workers ({auto['cpu']['source']}), "
              f"{auto['gaps_over_10ms']:g} gaps > 10 ms, {ratio}; engine's own throttle count "
              f"{auto['cpu']['throttle']['throttled']}")
        if auto.get("warnings"):
            print(f"{'':<11} auto warned: {auto['warnings'][0][:160]}")
        for n, r in rows.items():
            if n != "auto" and r.get("warnings"):
                print(f"{'':<11} {n} workers warned: {r['warnings'][0][:200]}")
                break


if __name__ == "__main__":
    main()
