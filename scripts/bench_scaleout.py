#!/usr/bin/env python3
"""Scale-out storage: write-through and prefetch GB/s of the `mp` engine through a
shared (network) filesystem, against that mount's raw ceiling and the local disk.

Two targets, the same measurements on each:

  juicefs   a JuiceFS volume (metadata in SQLite, data in a local directory as its
            object store) mounted twice, as two nodes: pages are written through
            mount A and read through mount B, whose client has never seen them
            (its kernel page cache and its JuiceFS block cache start empty).
            Or --mount-a/--mount-b: two mounts of any shared filesystem you have.
  local     a directory on the local disk (--local-dir), written and read in place.

  raw write   plain threads, each open + one pwritev of a page-sized file + close
              (bench_storage's per-file pattern); the best of --threads
  mp write    PrefetchEngine.backup() of the data set (temp file + rename per page)
  raw read    plain threads, open + one preadv + close per file, cold: each thread
              count reads a set of files nobody on that mount has read, after
              dropping the kernel page cache (drop_caches as root, else fadvise)
  mp read     PrefetchEngine.prefetch() of the engine's pages, cold the same way
  warm        both reads again (now in mount B's caches)

"÷ raw" is the engine over the best raw count of the same mount in the same run.
What moves these numbers on JuiceFS (all printed with the table): --buffer-size
(client read/write buffer, default 300 MiB), --cache-dir (the block cache a
re-read hits), --max-uploads (parallel object writes), --writeback (off: a close
returns once the blocks are in the object store), --prefetch (read-ahead blocks).
The volume's object store here is a local directory, so the figures show the
cost of the FUSE + JuiceFS client path on this machine, not a network.
Timings on a small machine are indicative; ratios from one run compare fairly.
"""
import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time


import bench_storage as bs
from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from hicache_mp.bench import jfs
from workers import pagefile

SCHEMA = "hicache_mp.bench_scaleout/1"
JFS_DEFAULTS = ["--buffer-size", "300", "--max-uploads", "20", "--prefetch", "1"]


def log(msg: str) -> None:
    print(msg, flush=True)


def engine(store: str, geometry: PageGeometry, workers: int, pool_pages: int,
           depth: int) -> PrefetchEngine:
    return PrefetchEngine(EngineConfig(storage_dir=store, num_workers=workers,
                                       host_pool_pages=pool_pages, direct_io="off",
                                       io_depth=depth, model_name="bench_scaleout"), geometry)


def measure(name: str, dir_a: str, dir_b: str, args, geometry: PageGeometry) -> dict:
    """Every figure for one target: writes through dir_a, reads through dir_b."""
    nbytes = pagefile.HEADER_SIZE + geometry.page_bytes
    n = args.pages
    out = {"target": name, "dir_a": dir_a, "dir_b": dir_b}
    raw_w, sets = {}, {}
    for t in args.threads:
        sub = f"raw{t}"
        os.makedirs(os.path.join(dir_a, sub), exist_ok=True)
        paths = [os.path.join(dir_a, sub, f"{i}.page") for i in range(n)]
        raw_w[t] = bs.raw_threads(paths, nbytes, t, write=True, direct=False)
        sets[t] = [os.path.join(dir_b, sub, f"{i}.page") for i in range(n)]
        log(f"  {name}: raw write, {t} threads: {raw_w[t]:.3f} GB/s")
    raw_r = {}
    method = None
    for t in args.threads:
        method = bs.drop_cache(sets[t])
        raw_r[t] = bs.raw_threads(sets[t], nbytes, t, write=False, direct=False)
        log(f"  {name}: raw cold read, {t} threads: {raw_r[t]:.3f} GB/s ({method})")
    best_r = max(raw_r, key=raw_r.get)
    raw_warm = bs.raw_threads(sets[best_r], nbytes, best_r, write=False, direct=False)
    log(f"  {name}: raw warm read ({best_r} threads) {raw_warm:.3f} GB/s")
    slots = list(range(args.pool_pages))
    mp = {}
    # The engine at its default depth, and with as many page I/Os in flight per
    # worker as the raw ceiling's best thread count (--hicache-mp-io-depth).
    for depth in sorted({1, max(raw_w, key=raw_w.get), best_r}):
        keys = [f"d{depth}-{i}" for i in range(n)]
        store = f"store{depth}"
        with engine(os.path.join(dir_a, store), geometry, args.workers, args.pool_pages,
                    depth) as e:
            bs.fill_pool(e)
            workers = e.worker_count()
            mp_w, counts = bs.run_ops(e, "backup", keys, slots)
            assert counts == {"ok": n}, counts
        with engine(os.path.join(dir_b, store), geometry, args.workers, args.pool_pages,
                    depth) as e:
            bs.drop_cache(bs.page_files(os.path.join(dir_b, store)))
            mp_r, counts = bs.run_ops(e, "prefetch", keys, slots)
            assert counts == {"ok": n}, counts
            mp_warm, _ = bs.run_ops(e, "prefetch", keys, slots)
        mp[depth] = {"write": mp_w, "read_cold": mp_r, "read_warm": mp_warm}
        log(f"  {name}: mp, {workers} workers x io_depth {depth}: write-through {mp_w:.3f}, "
            f"cold prefetch {mp_r:.3f}, warm {mp_warm:.3f} GB/s")
    best_w = max(raw_w, key=raw_w.get)
    out.update(workers=workers, cache_drop=method, raw_write=raw_w, raw_read_cold=raw_r,
               best_write_threads=best_w, best_read_threads=best_r, raw_read_warm=raw_warm,
               mp=mp)
    return out


def table(rows: list[dict]) -> str:
    head = ("| target | engine | write-through GB/s | ÷ raw | cold prefetch GB/s | ÷ raw "
            "| warm prefetch GB/s | ÷ raw |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        bw, br = r["raw_write"][r["best_write_threads"]], r["raw_read_cold"][r["best_read_threads"]]
        warm = r["raw_read_warm"]
        lines.append(f"| {r['target']} | raw threads (best of {len(r['raw_write'])} counts) | "
                     f"{bw:.2f} ({r['best_write_threads']} thr) | 1 | {br:.2f} "
                     f"({r['best_read_threads']} thr) | 1 | {warm:.2f} | 1 |")
        for depth, m in sorted(r["mp"].items()):
            lines.append(f"| {r['target']} | mp, {r['workers']} worker(s) x io_depth {depth} | "
                         f"{m['write']:.2f} | {m['write'] / bw:.2f} | {m['read_cold']:.2f} | "
                         f"{m['read_cold'] / br:.2f} | {m['read_warm']:.2f} | "
                         f"{m['read_warm'] / warm:.2f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pages", type=int, default=96, help="pages per data set")
    p.add_argument("--page-size", type=int, default=16,
                   help="tokens per page (32 layers x 8 KV heads x 128 dims, bf16: 16 tokens "
                        "= 2 MiB pages, 64 = 8 MiB)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="raw thread counts; the best is the ceiling")
    p.add_argument("--workers", type=int, default=0, help="engine workers (0 = auto)")
    p.add_argument("--pool-pages", type=int, default=32, help="engine host pool slots")
    p.add_argument("--mount-a", help="node A's mount of a shared filesystem (with --mount-b); "
                                     "default: a temporary JuiceFS volume")
    p.add_argument("--mount-b", help="node B's mount of the same filesystem")
    p.add_argument("--jfs-option", action="append", default=[],
                   help="extra `juicefs mount` option for the temporary volume, e.g. "
                        "--jfs-option=--buffer-size=1024 (repeatable)")
    p.add_argument("--local-dir", default=None, help="local disk directory (default: $TMPDIR)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if bool(args.mount_a) != bool(args.mount_b):
        p.error("--mount-a and --mount-b go together")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    geometry = PageGeometry(32, 8, 128, args.page_size, "bfloat16", "page_first")
    log(f"machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}; "
        f"{args.pages} pages of {geometry.page_bytes / 2**20:.0f} MiB per set")
    rows, volume, scratch = [], None, []
    try:
        if args.mount_a:
            a = tempfile.mkdtemp(prefix="bench_scaleout.", dir=args.mount_a)
            b = os.path.join(args.mount_b, os.path.basename(a))
            scratch.append(a)
            label, options = "shared mounts", []
        else:
            why = jfs.unavailable()
            if why:
                log(f"juicefs: {why}")
                return 2
            root = tempfile.mkdtemp(prefix="bench_scaleout.jfs.")
            scratch.append(root)
            options = JFS_DEFAULTS + args.jfs_option
            volume = jfs.Volume(root, nodes=2, mount_options=options)
            a, b = (os.path.join(m, "bench") for m in volume.mounts)
            os.makedirs(a)
            label = "juicefs"
            log(f"juicefs: volume at {root} (sqlite3 metadata, `file` object store on local "
                f"disk), mounted twice with: {' '.join(options)} "
                f"--cache-dir <per mount> (writeback off)")
        rows.append(measure(label, a, b, args, geometry))
        local = tempfile.mkdtemp(prefix="bench_scaleout.local.", dir=args.local_dir)
        scratch.append(local)
        rows.append(measure("local disk", local, local, args, geometry))
    finally:
        if volume is not None:
            volume.close()
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)
    log("")
    load = os.getloadavg()
    log(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} "
        f"CPUs (a busy machine makes every figure lower and noisier)")
    log(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "machine": platform.node(), "cpus": os.cpu_count(),
                       "page_bytes": geometry.page_bytes, "pages": args.pages,
                       "jfs_options": options, "rows": rows, "loadavg": load,
                       "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
