#!/usr/bin/env python3
"""Start-up time against store size: the engine's constructor, the background scan, and what they answer.

Builds one store of tiny page files written straight in the page-file
format (hicache_mp.bench.bigstore), grown to each size in turn, and at each
size starts a fresh `mp` engine and prints:

  - ctor_s: the constructor's wall time (what SGLang's attach waits for),
    beside that of an engine over an empty store made just before it (the
    part no store size changes: the workers' start, under the same load);
  - exists_s: the first exists() of 64 keys spread over the store, made at
    once after the constructor, while the scan runs (it must count all 64:
    keys the index does not know yet go through the workers' probes);
  - prefetch: those 64 pages read back and compared byte for byte;
  - scan_s: from the constructor's start until the scan has ended whole and
    the index holds every page (a poll loop, as a scheduler's), with the
    scheduler thread's poll() time meanwhile (total and the longest);
  - with --limit: capacity_s, until the evictor has measured the store, and
    whether its estimate is exact (N page files' bytes);
  - with --before: the synchronous walk the constructor used to make (the
    index's scan on this thread), timed in the same run.

    python scripts/bench_startup.py --dir /var/tmp/hicache_startup --sizes 10000,100000,1000000
    python scripts/bench_startup.py --dir /dev/shm/hicache_startup --sizes 10000,100000 --limit

The store is kept (grown, never rebuilt) between runs; --clean removes it
at the end. A million 512-byte pages are ~4.6 GB of files: on tmpfs that is
memory. The figures are with a warm dentry cache (the build just listed it).
"""
import argparse
import os
import random
import shutil
import sys
import time

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from hicache_mp.bench import bigstore
from hicache_mp.engine.index import StoreIndex

GEOMETRY = dict(num_layers=1, num_kv_heads=1, head_dim=32, page_size=4, dtype="bfloat16")  # 512 B
SAMPLE = 64
COUNT_FILE = ".bigstore-count"


def fs_type(path: str) -> str:
    best, kind = "", "?"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


def grow(root: str, geometry: PageGeometry, ns: str, size: int) -> float:
    """Grow the store to `size` pages; the seconds it took."""
    marker = os.path.join(root, COUNT_FILE)
    have = int(open(marker).read()) if os.path.exists(marker) else 0
    if have > size:
        raise SystemExit(f"{root} holds {have} pages, more than {size}: measure the sizes in "
                         f"increasing order, in another --dir")
    if have == size:
        return 0.0
    t0 = time.perf_counter()
    bigstore.build(root, geometry, ns, size - have, start=have)
    with open(marker, "w") as f:
        f.write(str(size))
    return time.perf_counter() - t0


def empty_ctor_s(root: str, geometry: PageGeometry, workers: int) -> float:
    """The constructor over an empty store: what start-up costs whatever the store."""
    empty = os.path.join(root, "empty")
    t0 = time.perf_counter()
    eng = PrefetchEngine(EngineConfig(storage_dir=empty, num_workers=workers,
                                      host_pool_pages=SAMPLE), geometry)
    took = time.perf_counter() - t0
    eng.close()
    shutil.rmtree(empty, ignore_errors=True)
    return took


def one_size(root: str, geometry: PageGeometry, size: int, args) -> dict:
    cfg = EngineConfig(storage_dir=root, num_workers=args.workers, host_pool_pages=SAMPLE,
                       storage_max_bytes=2 * max(size, 1000) * bigstore.file_bytes(geometry)
                       if args.limit else 0)
    rng = random.Random(size)
    sample = rng.sample(range(size), min(SAMPLE, size))  # size 0: the constant part alone
    keys = [bigstore.page_key(i) for i in sample]
    out = {"pages": size}
    t0, c0 = time.perf_counter(), time.thread_time()
    eng = PrefetchEngine(cfg, geometry)
    try:
        out["ctor_s"] = time.perf_counter() - t0
        out["ctor_cpu_ms"] = (time.thread_time() - c0) * 1e3
        out["indexed_at_ctor"] = eng.metrics()["index_pages"]
        t = time.perf_counter()
        out["exists"] = eng.exists(keys)
        out["exists_s"] = time.perf_counter() - t
        out["exists_absent"] = eng.exists(["bench-startup-absent-key"])
        op = eng.prefetch(keys, list(range(len(keys))))
        eng.wait(op, 60)
        wrong = sum(bytes(b"".join(eng.host_pool.page_iovecs(s))) !=
                    bigstore.payload(i, geometry.page_bytes) for s, i in enumerate(sample))
        out["prefetch"] = f"{op.status}, {len(keys) - wrong}/{len(keys)} exact"
        out["sample"] = len(keys)
        polls, poll_s, longest, poll_cpu, longest_cpu = 0, 0.0, 0.0, 0.0, 0.0
        capacity_s = None
        while True:
            t, c = time.perf_counter(), time.thread_time()
            eng.poll()
            dt, dc = time.perf_counter() - t, time.thread_time() - c
            polls, poll_s, longest = polls + 1, poll_s + dt, max(longest, dt)
            poll_cpu, longest_cpu = poll_cpu + dc, max(longest_cpu, dc)
            scan = eng.metrics()["store_scan"]
            if scan["state"] != "scanning" and "scan_s" not in out:
                out["scan_s"] = time.perf_counter() - t0
            if args.limit and capacity_s is None and scan["capacity"] == "counted":
                capacity_s = time.perf_counter() - t0
                out["capacity_estimate"] = eng.metrics()["store_bytes_estimate"]
            if scan["state"] != "scanning" and (not args.limit or capacity_s is not None):
                break
            if time.perf_counter() - t0 > args.timeout:
                break
            time.sleep(0.001)  # a scheduler step's worth of other work
        out.setdefault("scan_s", time.perf_counter() - t0)
        out["scan"] = scan
        out["indexed"] = eng.metrics()["index_pages"]
        out["polls"], out["poll_ms_total"], out["poll_ms_max"] = polls, poll_s * 1e3, longest * 1e3
        out["poll_cpu_ms_total"], out["poll_cpu_ms_max"] = poll_cpu * 1e3, longest_cpu * 1e3
        if args.limit:
            out["capacity_s"] = capacity_s
            out["capacity_exact"] = out.get("capacity_estimate") == \
                size * bigstore.file_bytes(geometry)
    finally:
        eng.close()
    if args.before:
        t, c = time.perf_counter(), time.thread_time()
        n = StoreIndex(root).scan()
        out["before_walk_s"] = time.perf_counter() - t
        out["before_walk_cpu_s"] = time.thread_time() - c
        out["before_pages"] = n
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp/hicache_startup",
                    help="the store (grown to each size; kept unless --clean)")
    ap.add_argument("--sizes", default="10000,100000,1000000",
                    help="comma-separated page counts, measured in increasing order")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit", action="store_true",
                    help="run with storage_max_bytes (twice the store): an evictor, whose "
                         "first measure of the store is timed and checked")
    ap.add_argument("--before", action="store_true",
                    help="also time the synchronous walk the constructor used to make")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="give up waiting for a scan after this long (s)")
    ap.add_argument("--clean", action="store_true", help="remove the store at the end")
    args = ap.parse_args()
    geometry = PageGeometry(**GEOMETRY, layout="page_first")
    sizes = sorted(int(s) for s in args.sizes.split(","))
    ns = bigstore.store_namespace(EngineConfig(storage_dir=args.dir), geometry)
    print(f"store {args.dir} ({fs_type(os.path.dirname(args.dir) or '.')}), pages of "
          f"{bigstore.file_bytes(geometry)} bytes, {args.workers} workers, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}")
    ok = True
    scratch = args.dir.rstrip("/") + ".scratch"
    try:
        empty_ctor_s(scratch, geometry, args.workers)  # the process's first engine: one-time costs
        for size in sizes:
            built = grow(args.dir, geometry, ns, size)
            base = empty_ctor_s(scratch, geometry, args.workers)
            r = one_size(args.dir, geometry, size, args)
            n = r["sample"]
            good = r["exists"] == n and r["exists_absent"] == 0 and \
                r["prefetch"].endswith(f"{n}/{n} exact") and r["indexed"] == size and \
                r["scan"]["complete"] and (not args.limit or r["capacity_exact"])
            ok = ok and good
            line = (f"{size:>9} pages (built in {built:.1f} s): ctor {r['ctor_s']:.3f} s, "
                    f"{r['ctor_cpu_ms']:.0f} ms CPU of this thread (empty store's just before: "
                    f"{base:.3f} s; index {r['indexed_at_ctor']} at return); exists {r['exists']}/{n} in "
                    f"{r['exists_s'] * 1e3:.1f} ms, absent key {r['exists_absent']}; prefetch "
                    f"{r['prefetch']}; scan whole at {r['scan_s']:.2f} s, index {r['indexed']}; "
                    f"poll() during it {r['poll_ms_total']:.0f} ms over {r['polls']} polls "
                    f"({r['poll_cpu_ms_total']:.0f} ms CPU), longest {r['poll_ms_max']:.2f} ms "
                    f"({r['poll_cpu_ms_max']:.2f} ms CPU)")
            if args.limit:
                line += (f"; capacity counted at {r['capacity_s'] or float('nan'):.2f} s, "
                         f"estimate {r.get('capacity_estimate')} "
                         f"({'exact' if r['capacity_exact'] else 'NOT exact'})")
            if args.before:
                line += (f"; before: the constructor's walk {r['before_walk_s']:.2f} s "
                         f"({r['before_walk_cpu_s']:.2f} s CPU)")
            print(line + ("" if good else "  <-- WRONG"), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if args.clean:
            shutil.rmtree(args.dir, ignore_errors=True)
    print("all answers correct" if ok else "SOME ANSWERS WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
