#!/usr/bin/env python3
"""bench_copy_paths: how fast N processes can move warm page files into shared memory.

A warm load is a copy: page-cache pages of the store's files into rows of a
/dev/shm mapping (vLLM's CPU tier, SGLang's host pool). No tier can load
faster than the machine copies. This measures, with no engine, the bytes per
second of N processes that each take every N-th of ROWS page files (one file
per row, as the store keeps them) and put it into its row of one shared
mapping, by each way there is:

  preadv  open, one os.preadv straight into the row, close: what the
          engine's workers do (the kernel's copy_to_user);
  mmap    open, map the file (MAP_POPULATE), one numpy copy into the row
          (glibc's memcpy: non-temporal stores for large copies), close;
  memcpy  the same copy from a private buffer already in memory: no file at
          all, the copy ceiling.

Every process maps the destination once and touches it before the clock
starts, as a worker's long-lived mapping is. The first and last rows are
checked after each cell.

    python scripts/bench_copy_paths.py                          # N = 4, 8, cores - 2
    python scripts/bench_copy_paths.py --counts 14 --rows 1024 --dir /tmp --json out.json
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

MODES = ("preadv", "mmap", "memcpy")


def _file(d: str, i: int) -> str:
    return os.path.join(d, f"{i:05d}.page")


def mover(mode: str, me: int, n: int, rows: int, row_bytes: int, d: str, dest: str,
          cpu, start, done, stop) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    fd = os.open(dest, os.O_RDWR)
    whole = mmap.mmap(fd, rows * row_bytes)
    os.close(fd)
    out = np.frombuffer(whole, dtype=np.uint8).reshape(rows, row_bytes)
    mine = list(range(me, rows, n))
    for r in mine:
        out[r, ::4096] = 0  # the long-lived mapping: every page present before the clock
    private = np.ones(row_bytes, dtype=np.uint8) if mode == "memcpy" else None
    while True:
        start.wait()
        if stop.is_set():
            break
        for r in mine:
            if mode == "memcpy":
                np.copyto(out[r], private)
                continue
            f = os.open(_file(d, r), os.O_RDONLY)
            try:
                if mode == "preadv":
                    os.preadv(f, [out[r]], 0)
                else:
                    m = mmap.mmap(f, row_bytes, prot=mmap.PROT_READ,
                                  flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                    src = np.frombuffer(m, dtype=np.uint8)
                    np.copyto(out[r], src)
                    del src
                    m.close()
            finally:
                os.close(f)
        done.wait()
    del out
    whole.close()


def cell(mode: str, n: int, args, d: str, cpus: list) -> list:
    ctx = mp.get_context("fork")
    start, done, stop = ctx.Barrier(n + 1), ctx.Barrier(n + 1), ctx.Event()
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="hicache_mp_copy_") as dest:
        dest.truncate(args.rows * args.row_bytes)
        procs = [ctx.Process(target=mover, daemon=True,
                             args=(mode, i, n, args.rows, args.row_bytes, d, dest.name,
                                   cpus[i % len(cpus)] if cpus else None, start, done, stop))
                 for i in range(n)]
        for p in procs:
            p.start()
        rates = []
        try:
            for _ in range(args.repeats):
                start.wait(60)
                t0 = time.perf_counter()
                done.wait(120)
                rates.append(args.rows * args.row_bytes / (time.perf_counter() - t0) / 1e9)
            if mode != "memcpy":
                with open(dest.name, "rb") as f:
                    for r in (0, args.rows - 1):
                        f.seek(r * args.row_bytes)
                        with open(_file(d, r), "rb") as g:
                            if f.read(args.row_bytes) != g.read():
                                raise SystemExit(f"{mode}: row {r} wrong")
        finally:
            stop.set()
            try:
                start.wait(10)
            except Exception:
                pass
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    return rates


def main(argv=None) -> int:
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--counts", type=int, nargs="+",
                   default=sorted({min(4, cores), min(8, cores), max(1, cores - 2)}),
                   help="processes per cell")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--rows", type=int, default=512, help="page files, one row each")
    p.add_argument("--row-bytes", type=int, default=2 << 20)
    p.add_argument("--repeats", type=int, default=5, help="timed passes per cell (median)")
    p.add_argument("--dir", default=None, help="where the page files go (default: a temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="hicache_mp_copy_") as d:
        block = np.random.default_rng(1).integers(0, 255, args.row_bytes, dtype=np.uint8)
        for i in range(args.rows):
            block[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
            with open(_file(d, i), "wb") as f:
                f.write(block.tobytes())
        for i in range(args.rows):  # into the page cache
            with open(_file(d, i), "rb") as f:
                f.read()
        gib = args.rows * args.row_bytes / (1 << 30)
        print(f"{cores} CPUs; {args.rows} files of {args.row_bytes >> 10} KiB ({gib:.2f} GiB) "
              f"into one /dev/shm mapping; GB/s median of {args.repeats} (min-max)", flush=True)
        print(f"{'mode':<8}{'N':>4}{'GB/s':>8}{'range':>16}", flush=True)
        out = []
        for mode in args.modes:
            for n in args.counts:
                rates = cell(mode, n, args, d, cpus)
                med = statistics.median(rates)
                out.append({"mode": mode, "procs": n, "gbps": med, "rounds": rates})
                print(f"{mode:<8}{n:>4}{med:>8.2f}{min(rates):>8.2f}-{max(rates):<7.2f}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": cores, "args": vars(args), "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
