#!/usr/bin/env python3
"""bench_contention: what the machine alone does to a pure-Python scheduler loop.

A serving host's scheduler thread shares the machine with whatever moves the
KV bytes. This measures, with no engine and no tier at all, the rate of the
same pure-Python loop the tier benchmarks use (hicache_mp.bench.loop.spin_for) while N
other processes run, for each kind of neighbour:

  cpu     a pure-Python loop of its own (no memory traffic): cores shared
          with the loop (hyperthread siblings, an over-subscribed host) or a
          lower clock show here;
  memcpy  numpy copies between two 64 MiB buffers: memory bandwidth and the
          shared last-level cache;
  preadv  os.preadv of a page-cache-warm file into a shared /dev/shm buffer,
          8 MiB at a time: what the engine's workers do for a warm load.

Each cell is the loop's rate beside N neighbours over its rate alone,
measured just before and after (the machine drifts), with the loop on one CPU
and the neighbours on the others (as far as there are others). The
neighbours' own GB/s are printed beside, so a ratio reads against the bytes
moved. It says whether a loop-rate target can be met by any process that
moves bytes at that rate, on this machine.

    python scripts/bench_contention.py                    # N = 4, 8, cores - 2
    python scripts/bench_contention.py --counts 2 14 --seconds 2 --json out.json
"""
import argparse
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from hicache_mp.bench.loop import spin_rate

COPY_BYTES = 64 << 20
READ_BYTES = 8 << 20


def neighbour(kind: str, cpu: int | None, path: str, stop, moved, ready) -> None:
    """One neighbour process: `kind`'s work until `stop` is set; bytes into `moved`."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    done = 0
    if kind == "cpu":
        ready.release()
        while not stop.is_set():
            spin_rate(0.05)
    elif kind == "memcpy":
        a = np.ones(COPY_BYTES, dtype=np.uint8)
        b = np.empty_like(a)
        ready.release()
        while not stop.is_set():
            np.copyto(b, a)
            done += COPY_BYTES
    else:
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        shm = tempfile.TemporaryFile(dir="/dev/shm")
        shm.truncate(READ_BYTES)
        buf = mmap.mmap(shm.fileno(), READ_BYTES)
        ready.release()
        off = 0
        while not stop.is_set():
            done += os.preadv(fd, [buf], off)
            off = (off + READ_BYTES) % size
        buf.close()
        os.close(fd)
    with moved.get_lock():
        moved.value += done


def cell(kind: str, n: int, seconds: float, cpus: list, path: str) -> dict:
    ctx = mp.get_context("fork")
    stop, moved, ready = ctx.Event(), ctx.Value("d", 0.0), ctx.Semaphore(0)
    others = cpus[:-1] or cpus
    procs = [ctx.Process(target=neighbour, daemon=True,
                         args=(kind, others[i % len(others)] if len(cpus) > 1 else None,
                               path, stop, moved, ready)) for i in range(n)]
    before = spin_rate(seconds / 2)
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire(timeout=30)
    t0 = time.perf_counter()
    beside = spin_rate(seconds)
    dt = time.perf_counter() - t0
    stop.set()
    for p in procs:
        p.join(10)
    after = spin_rate(seconds / 2)
    alone = (before + after) / 2
    return {"kind": kind, "neighbours": n, "loop_alone": alone, "loop_beside": beside,
            "ratio": beside / alone, "neighbour_gbps": moved.value / dt / 1e9}


def main(argv=None) -> int:
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--counts", type=int, nargs="+",
                   default=sorted({min(4, cores - 1), min(8, cores - 1), max(1, cores - 2)}),
                   help="neighbour processes per cell")
    p.add_argument("--kinds", nargs="+", default=["cpu", "memcpy", "preadv"],
                   choices=["cpu", "memcpy", "preadv"])
    p.add_argument("--seconds", type=float, default=1.5, help="the loop's time beside them")
    p.add_argument("--repeats", type=int, default=2, help="median of this many per cell")
    p.add_argument("--file-mib", type=int, default=512, help="the warm file preadv reads")
    p.add_argument("--dir", default=None, help="where that file goes (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[-1]})  # the loop's CPU; neighbours on the others
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "warm")
        if "preadv" in args.kinds:
            with open(path, "wb") as f:
                for _ in range(args.file_mib):
                    f.write(os.urandom(1 << 20))
            with open(path, "rb") as f:  # into the page cache
                while f.read(64 << 20):
                    pass
        print(f"{cores} CPUs; the loop on CPU {cpus[-1]}, neighbours on the others; "
              f"ratio = loop beside N neighbours / loop alone (just before and after), "
              f"median of {args.repeats}", flush=True)
        print(f"{'kind':<8}{'N':>4}{'loop M it/s alone':>19}{'beside':>8}{'ratio':>7}"
              f"{'neighbours GB/s':>17}", flush=True)
        rows = []
        for kind in args.kinds:
            for n in args.counts:
                runs = [cell(kind, n, args.seconds, cpus, path) for _ in range(args.repeats)]
                row = dict(runs[0], ratio=statistics.median(r["ratio"] for r in runs),
                           neighbour_gbps=statistics.median(r["neighbour_gbps"] for r in runs),
                           ratios=[r["ratio"] for r in runs])
                rows.append(row)
                print(f"{kind:<8}{n:>4}{row['loop_alone'] / 1e6:>19.2f}"
                      f"{row['loop_beside'] / 1e6:>8.2f}{row['ratio']:>7.2f}"
                      f"{row['neighbour_gbps']:>17.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": cores, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
