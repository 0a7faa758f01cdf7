#!/usr/bin/env python3
"""Prefetch throughput: `mp` engine vs the threaded `file` and `fast_file` baselines vs the raw ceiling.

Everything is measured in one run on the same page files (page cache warm):

  raw ceiling     W plain processes preadv-ing their share of the files into a
                  MAP_POPULATE'd shared pool (no engine, no rings)
  mp  idle/busy   PrefetchEngine with W workers; the main thread either sleeps
                  in engine.wait() or runs a busy pure-Python scheduler loop
                  that calls poll() every iteration
  file idle/busy  the in-process threaded baseline under the same two loops
  fast_file idle/busy  the replica of SGLang PR #39880 (readv into the pool,
                  R read threads; --fast-file-read-workers) under the same loops
  loop rate       iterations/s of that busy loop with no I/O, and while mp
                  prefetches at full speed
  loop floor      the same loop (no poll()) beside W plain reader processes
                  that copy the same bytes at mp busy's rate in the same round
                  (hicache_mp.bench.floor: no engine, no rings): what the
                  machine alone costs the loop. The engine's own cost is
                  loop(beside mp) / loop(beside the floor's readers)
  poll() cost     median/p99 of poll() with 24 ops in flight

It prints the ratios docs/design.md §6 sets targets for; `--json` writes every figure.
Timings on a small CI machine only catch regressions; report figures from a
real box (docs/results.md).
"""
import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from hicache_mp import EngineConfig, PageGeometry, make_engine
from hicache_mp.bench.floor import PacedReaders
from hicache_mp.bench.loop import idle_loop_rate, scheduler_step
from hicache_mp.engine.config import auto_workers
from shm import HostPool, new_owner_tag
from workers import naming, pagefile

OP_PAGES = 128          # one op = 128 pages = 1 GiB at 8 MiB pages, as in the user's logs
POLL_OPS = 24


def log(msg: str) -> None:
    print(f"[bench_prefetch {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- running prefetches -------------------------------------------------------
def run_prefetch(engine, keys, rounds: int, busy: bool, cap_s: float) -> dict:
    """Prefetch every key `rounds` times in OP_PAGES ops; GB/s and loop rate."""
    n = len(keys)
    slots = np.arange(n)
    page_bytes = engine.geometry.page_bytes
    landed = 0
    iters = 0
    t0 = time.perf_counter()
    deadline = t0 + cap_s
    capped = False
    for _ in range(rounds):
        ops = [engine.prefetch(keys[i:i + OP_PAGES], slots[i:i + OP_PAGES]) for i in range(0, n, OP_PAGES)]
        if busy:
            while not all(op.done for op in ops):
                scheduler_step(engine)
                iters += 1
                if time.perf_counter() > deadline:
                    break
        else:
            for op in ops:
                engine.wait(op, max(0.0, deadline - time.perf_counter()))
        if time.perf_counter() > deadline:
            capped = True
            for op in ops:
                engine.cancel(op)
            landed += sum(op.completed_pages for op in ops)
            for op in ops:
                engine.wait(op, 60)
            break
        bad = [op for op in ops if op.status != "ok"]
        if bad:
            raise RuntimeError(f"prefetch failed: {bad[0]} {bad[0].status_counts()}")
        landed += sum(op.completed_pages for op in ops)
    elapsed = time.perf_counter() - t0 if not capped else cap_s
    return {"gbps": landed * page_bytes / elapsed / 1e9, "seconds": elapsed, "pages": landed,
            "loop_rate": iters / elapsed if busy else None, "capped": capped, "ops": ops}


def _median_run(runs: list) -> dict:
    runs = sorted(runs, key=lambda r: r["gbps"])
    mid = dict(runs[len(runs) // 2])
    mid.pop("ops", None)
    mid["all_gbps"] = [r["gbps"] for r in runs]
    return mid


def floor_round(readers, seconds: float, ops) -> dict:
    """The busy loop, step for step as in `run_prefetch` less the poll(), for
    `seconds` beside `readers` moving their bytes in that time."""
    start = readers.start(seconds)
    while time.monotonic() < start:
        pass
    iters = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    # `ops` are finished: the loop's "all done?" check costs what it costs in
    # the mp round, and never ends the loop.
    while not all(op.done and op.num_pages < 0 for op in ops):
        scheduler_step(None)
        iters += 1
        if time.perf_counter() > deadline:
            break
    elapsed = time.perf_counter() - t0
    moved = readers.finish()
    return {"loop_rate": iters / elapsed, "seconds": elapsed, "readers_gbps": moved["gbps"],
            "readers": moved["workers"]}


def poll_cost(engine, keys) -> dict:
    per_op = max(1, len(keys) // POLL_OPS)
    ops = [engine.prefetch(keys[i * per_op:(i + 1) * per_op], np.arange(i * per_op, (i + 1) * per_op))
           for i in range(POLL_OPS)]
    samples = []
    while not all(op.done for op in ops):
        t = time.perf_counter_ns()
        engine.poll()
        samples.append(time.perf_counter_ns() - t)
    samples.sort()
    return {"median_us": samples[len(samples) // 2] / 1e3,
            "p99_us": samples[int(len(samples) * 0.99)] / 1e3, "calls": len(samples),
            "ops_in_flight": POLL_OPS}


# --- raw ceiling --------------------------------------------------------------
def _read_share(pool, paths, share, rounds: int) -> None:
    header = bytearray(pagefile.HEADER_SIZE)
    for _ in range(rounds):
        for i in share:
            fd = os.open(paths[i], os.O_RDONLY)
            os.preadv(fd, [header, *pool.page_iovecs(i)], 0)
            os.close(fd)


def _raw_reader(args):
    pool_name, pool_pages, geometry, paths, share, rounds, repeats, barrier = args
    pool = HostPool(PageGeometry.from_dict(geometry), pool_pages, name=pool_name, create=False)
    for _ in range(repeats):
        barrier.wait()
        _read_share(pool, paths, share, rounds)
        barrier.wait()
    pool.close()


def raw_ceiling(paths, geometry, workers: int, rounds: int, repeats: int) -> dict:
    """Plain readers with no engine: processes, and threads (preadv releases the
    GIL) in one process. Each is repeated like the engine runs (the first pass
    over fresh memory is slow on VMs that fault guest memory in lazily) and the
    median kept; the ceiling is the better of the two, so mp meets the higher bar."""
    import threading
    n = len(paths)
    total = n * rounds * geometry.page_bytes
    shares = [list(range(w, n, workers)) for w in range(workers)]
    pool = HostPool(geometry, n, name=new_owner_tag() + ".raw", create=True)
    procs, threads = [], []
    ctx = mp.get_context("spawn")
    try:
        with ctx.Manager() as manager:
            barrier = manager.Barrier(workers + 1)
            with ctx.Pool(workers) as readers:
                result = readers.map_async(_raw_reader, [(pool.name, n, geometry.to_dict(), paths, sh, rounds,
                                                          repeats, barrier) for sh in shares])
                for _ in range(repeats):
                    barrier.wait()
                    t0 = time.perf_counter()
                    barrier.wait()
                    procs.append(total / (time.perf_counter() - t0) / 1e9)
                result.get()
        for _ in range(repeats):
            ts = [threading.Thread(target=_read_share, args=(pool, paths, sh, rounds)) for sh in shares]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            threads.append(total / (time.perf_counter() - t0) / 1e9)
    finally:
        pool.close()
    p, t = statistics.median(procs), statistics.median(threads)
    return {"gbps": max(p, t), "processes_gbps": p, "threads_gbps": t,
            "processes_all": procs, "threads_all": threads, "workers": workers}


# --- main ---------------------------------------------------------------------
def build_store(args, geometry, store) -> list[str]:
    keys = [f"bench-page-{i}" for i in range(args.pages)]
    cfg = EngineConfig(storage_dir=store, num_workers=args.workers[-1], host_pool_pages=args.pages,
                       model_name="bench")
    with make_engine("mp", cfg, geometry) as eng:
        if eng.exists(keys) < len(keys):
            log(f"writing {args.pages} pages of {geometry.page_bytes / 2**20:.2f} MiB to {store}")
            gen = torch.Generator().manual_seed(0)
            t = eng.host_pool.tensor.view(torch.int16)
            t.copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16, generator=gen))
            t0 = time.perf_counter()
            op = eng.backup(keys, range(args.pages))
            eng.wait(op)
            if op.status != "ok":
                raise RuntimeError(f"could not write the store: {op.status_counts()}")
            args.backup_gbps = args.pages * geometry.page_bytes / (time.perf_counter() - t0) / 1e9
            log(f"store written at {args.backup_gbps:.2f} GB/s")
        ns = eng.namespace
    return keys, [naming.page_path(cfg.storage_dir, naming.key_digest(k, ns)) for k in keys]


def warm_page_cache(paths) -> None:
    buf = bytearray(1 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1024, help="pages in the store (default 1024 = 8 GiB at 8 MiB)")
    ap.add_argument("--rounds", type=int, default=3, help="times each measurement reads every page (default 3)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="idle/busy measurement pairs per worker count, interleaved; medians reported (default 3)")
    ap.add_argument("--workers", type=int, nargs="+", default=[0],
                    help="worker counts to sweep; the last is used for the headline ratios (default: auto)")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    ap.add_argument("--num-layers", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hicache-mem-layout", default="page_first", choices=["page_first", "layer_first"])
    ap.add_argument("--storage-dir", default=None, help="store directory (default: a temp dir, removed after)")
    ap.add_argument("--file-cap-s", type=float, default=15.0,
                    help="stop a baseline measurement after this long and report what landed (default 15)")
    ap.add_argument("--fast-file-read-workers", type=int, nargs="+", default=[1], metavar="R",
                    help="fast_file read thread counts to measure (default 1, as upstream)")
    ap.add_argument("--pin-workers", action="store_true",
                    help="pin mp workers off the scheduler's core and its hyperthread siblings")
    ap.add_argument("--quick", action="store_true", help="small pages and store, for a CPU smoke run")
    ap.add_argument("--json", default=None, help="write every figure to this path")
    args = ap.parse_args(argv)
    if args.quick:
        args.pages, args.rounds, args.num_layers, args.page_size, args.repeats = 128, 2, 8, 32, 1
    args.workers = [w or auto_workers() for w in args.workers]
    args.backup_gbps = None
    geometry = PageGeometry(args.num_layers, args.num_kv_heads, args.head_dim, args.page_size,
                            "bfloat16", args.hicache_mem_layout)
    store = args.storage_dir or tempfile.mkdtemp(prefix="hicache_mp_bench_")
    out = {"pin_workers": args.pin_workers, "geometry": geometry.to_dict(), "page_bytes": geometry.page_bytes, "pages": args.pages,
           "rounds": args.rounds, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    try:
        keys, paths = build_store(args, geometry, store)
        out["backup_gbps"] = args.backup_gbps
        log("warming the page cache")
        warm_page_cache(paths)
        out["sweep"] = {}
        for w in args.workers:
            log(f"raw ceiling with {w} reader processes")
            raw = raw_ceiling(paths, geometry, w, args.rounds, args.repeats)
            cfg = EngineConfig(storage_dir=store, num_workers=w, host_pool_pages=args.pages, model_name="bench",
                               pin_workers=args.pin_workers)
            items = [(p, pagefile.HEADER_SIZE, geometry.page_bytes) for p in paths]
            with make_engine("mp", cfg, geometry) as eng, \
                    PacedReaders(items, w, passes=args.rounds) as readers:
                log(f"mp with {w} workers: idle and busy scheduler, and the loop beside the floor's "
                    f"readers, interleaved x{args.repeats}")
                loop_idle, idles, busys, floors = [], [], [], []
                for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
                    idles.append(run_prefetch(eng, keys, args.rounds, busy=False, cap_s=600))
                    loop_idle.append(idle_loop_rate(eng, 0.5, idles[-1]["ops"]))
                    busys.append(run_prefetch(eng, keys, args.rounds, busy=True, cap_s=600))
                    floors.append(floor_round(readers, busys[-1]["seconds"], busys[-1]["ops"]))
                    floors[-1]["loop_ratio"] = busys[-1]["loop_rate"] / floors[-1]["loop_rate"]
                idle, busy = _median_run(idles), _median_run(busys)
                pc = poll_cost(eng, keys)
                m = eng.metrics()
            ratios = [f["loop_ratio"] for f in floors]
            out["sweep"][w] = {"raw": raw, "mp_idle": idle, "mp_busy": busy, "poll": pc,
                               "loop_rate_idle": statistics.median(loop_idle),
                               "loop_rate_idle_all": loop_idle,
                               "loop_rate_busy_all": [b["loop_rate"] for b in busys],
                               "floor": {"loop_rate": statistics.median(f["loop_rate"] for f in floors),
                                         "readers_gbps": statistics.median(f["readers_gbps"] for f in floors),
                                         "loop_over_floor": statistics.median(ratios),
                                         "loop_over_floor_all": ratios, "rounds": floors},
                               "worker_busy": m["worker_busy"]}
            log(f"  raw {raw['gbps']:.2f} GB/s | mp idle {idle['gbps']:.2f} | mp busy {busy['gbps']:.2f} "
                f"| loop beside mp / beside the floor {statistics.median(ratios):.2f} "
                f"| poll median {pc['median_us']:.1f} µs")
        cfg = EngineConfig(storage_dir=store, num_workers=1, host_pool_pages=args.pages, model_name="bench")
        with make_engine("file", cfg, geometry) as eng:
            log("file baseline: idle scheduler")
            out["file_idle"] = run_prefetch(eng, keys, 1, busy=False, cap_s=args.file_cap_s)
            log("file baseline: busy scheduler")
            out["file_busy"] = run_prefetch(eng, keys, 1, busy=True, cap_s=args.file_cap_s)
            out["file_idle"].pop("ops"), out["file_busy"].pop("ops")
        out["fast_file"] = {}
        for r in args.fast_file_read_workers:
            with make_engine("fast_file", cfg, geometry, read_workers=r) as eng:
                log(f"fast_file baseline, {r} read threads: idle then busy scheduler")
                idle = run_prefetch(eng, keys, 1, busy=False, cap_s=args.file_cap_s)
                busy = run_prefetch(eng, keys, 1, busy=True, cap_s=args.file_cap_s)
                idle.pop("ops"), busy.pop("ops")
            out["fast_file"][r] = {"idle": idle, "busy": busy}
    finally:
        if not args.storage_dir:
            shutil.rmtree(store, ignore_errors=True)
    head = out["sweep"][args.workers[-1]]
    out["ratios"] = {
        "mp_busy_over_idle": head["mp_busy"]["gbps"] / head["mp_idle"]["gbps"],
        "mp_over_raw_ceiling": head["mp_idle"]["gbps"] / head["raw"]["gbps"],
        "mp_busy_over_raw_ceiling": head["mp_busy"]["gbps"] / head["raw"]["gbps"],
        "loop_rate_during_mp_over_idle": head["mp_busy"]["loop_rate"] / head["loop_rate_idle"],
        # The engine's own cost to the loop: the floor's readers move the same
        # bytes at the same rate (median of the rounds' paired ratios).
        "loop_beside_mp_over_floor": head["floor"]["loop_over_floor"],
        "loop_floor_over_idle": head["floor"]["loop_rate"] / head["loop_rate_idle"],
        "file_busy_over_idle": _ratio(out["file_busy"]["gbps"], out["file_idle"]["gbps"]),
        # A starved baseline may move nothing within its cap (seen on the H200
        # box under a CPU quota): its ratio is then unbounded, reported as None.
        "mp_busy_over_file_busy": _ratio(head["mp_busy"]["gbps"], out["file_busy"]["gbps"]),
        "mp_busy_over_fast_file_busy": {r: _ratio(head["mp_busy"]["gbps"], f["busy"]["gbps"])
                                        for r, f in out["fast_file"].items()},
        "poll_median_us": head["poll"]["median_us"],
    }
    print_report(out, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
        log(f"wrote {args.json}")
    return out


def _ratio(num: float, den: float):
    """num / den, or None where the denominator moved nothing."""
    return num / den if den else None


def _shown(ratio, width: int, digits: int, cap_s: float) -> str:
    if ratio is None:
        return f"{'n/a':>{width}}   (the baseline moved no page in its {cap_s:g} s cap)"
    return f"{ratio:>{width}.{digits}f}"


def print_report(out, args) -> None:
    pb = out["page_bytes"] / 2**20
    print(f"\n== prefetch, {out['pages']} pages of {pb:.2f} MiB x {out['rounds']} rounds, page cache warm, "
          f"{out['cpus']} CPUs ==")
    print(f"{'workers':>7} {'raw GB/s':>9} {'mp idle':>8} {'mp busy':>8} {'mp/raw':>7} {'busy/idle':>9} "
          f"{'loop busy/idle':>14} {'poll med µs':>11}")
    for w, r in out["sweep"].items():
        print(f"{w:>7} {r['raw']['gbps']:>9.2f} {r['mp_idle']['gbps']:>8.2f} {r['mp_busy']['gbps']:>8.2f} "
              f"{r['mp_idle']['gbps'] / r['raw']['gbps']:>7.2f} {r['mp_busy']['gbps'] / r['mp_idle']['gbps']:>9.2f} "
              f"{r['mp_busy']['loop_rate'] / r['loop_rate_idle']:>14.2f} {r['poll']['median_us']:>11.1f}")
    fi, fb = out["file_idle"], out["file_busy"]
    print(f"file baseline (1 thread): idle {fi['gbps']:.2f} GB/s, busy {fb['gbps']:.3f} GB/s"
          f"{' (capped)' if fb['capped'] else ''}")
    for r, f in out["fast_file"].items():
        print(f"fast_file ({r} read thread{'s' if r > 1 else ''}): idle {f['idle']['gbps']:.2f} GB/s, "
              f"busy {f['busy']['gbps']:.3f} GB/s{' (capped)' if f['busy']['capped'] else ''}"
              f"   [mp with {args.workers[-1]} workers: idle {out['sweep'][args.workers[-1]]['mp_idle']['gbps']:.2f}, "
              f"busy {out['sweep'][args.workers[-1]]['mp_busy']['gbps']:.2f}]")
    head = out["sweep"][args.workers[-1]]
    fl = head["floor"]
    print(f"scheduler loop: idle {head['loop_rate_idle']:.0f} it/s, during mp prefetch "
          f"{head['mp_busy']['loop_rate']:.0f} it/s, beside the floor's {fl['rounds'][0]['readers']} "
          f"plain readers {fl['loop_rate']:.0f} it/s (they moved {fl['readers_gbps']:.2f} GB/s; "
          f"mp busy {head['mp_busy']['gbps']:.2f})")
    spread = ", ".join(f"{x:.3f}" for x in fl["loop_over_floor_all"])
    print(f"loop beside mp / beside the floor, per round: {spread}")
    r = out["ratios"]
    print("\nratio                                   measured   target")
    print(f"mp busy / mp idle GB/s                  {r['mp_busy_over_idle']:>8.2f}   >= 0.97")
    print(f"mp idle / raw preadv ceiling            {r['mp_over_raw_ceiling']:>8.2f}   >= 0.95")
    print(f"loop rate during mp / idle loop rate    {r['loop_rate_during_mp_over_idle']:>8.2f}   "
          f"(floor / idle {r['loop_floor_over_idle']:.2f}: the machine's share)")
    print(f"loop beside mp / beside plain readers   {r['loop_beside_mp_over_floor']:>8.3f}   >= 0.97 "
          "(the engine's own cost)")
    print(f"poll() median, 24 ops in flight (µs)    {r['poll_median_us']:>8.1f}   <= 2 "
          f"(p99 {out['sweep'][args.workers[-1]]['poll']['p99_us']:.1f}, <= 20)")
    cap = args.file_cap_s
    print(f"file busy / file idle GB/s              {_shown(r['file_busy_over_idle'], 8, 3, cap)}"
          "   (the pathology)")
    print(f"mp busy / file busy GB/s                {_shown(r['mp_busy_over_file_busy'], 8, 1, cap)}")
    for n, ratio in r["mp_busy_over_fast_file_busy"].items():
        print(f"mp busy / fast_file busy GB/s ({n} rd)   {_shown(ratio, 8, 1, cap)}")


if __name__ == "__main__":
    main()
