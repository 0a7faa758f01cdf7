#!/usr/bin/env python3
"""Storage at the limit: cold-read and write-through GB/s of the `mp` engine against
raw ceilings measured in the same run, a sweep over worker counts, and reads
mixed with writes.

Everything runs on one directory (so one device):

  raw write ceiling  max of: P parallel `dd oflag=direct` streams (bs = one page
                     file), T plain threads and T plain processes pwritev-ing
                     page-sized files (O_DIRECT when the engine uses it; the
                     GIL is released in the syscall)
  mp write           PrefetchEngine.backup() of the data set, W workers x D
                     I/Os in flight each (--io-depth, workers.lanes)
  raw read ceiling   max of: P parallel `dd iflag=direct` streams, T plain
                     threads and T plain processes preadv-ing the engine's own
                     page files
  mp cold read       PrefetchEngine.prefetch() of the data set, W workers x D
  mixed              with the most workers and the depth that read best there:
                     a stream of prefetches alone, then the same stream with a
                     backup stream beside it, in turn (--mixed-repeats), one
                     engine; reads must keep >= 0.8 of their read-only GB/s
                     (issues 7, 13). Buffered, the reads come from the page
                     cache (--mixed-cache warm); with O_DIRECT, cold.
                     --mixed-only runs just this (no ceilings, no sweep)

"Cold": before every read pass the page cache is dropped (`sync; echo 1 >
/proc/sys/vm/drop_caches` when allowed, else posix_fadvise(DONTNEED) on every
file); with O_DIRECT the cache is bypassed anyway. The method used is printed
and written to the JSON.

Ratios printed (issue 7 targets, 8 MiB pages on the H200 box): mp read / raw
read >= 0.90, mp write / raw write >= 0.90, mixed read / read-only >= 0.80.
Timings on a small CI machine only catch regressions; `--quick` is for that.
"""
import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time


from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from hicache_mp.bench import coldcache
from hicache_mp.engine.config import DIRECT_IO_MODES, FSYNC_MODES, auto_workers
from workers import directio, naming, pagefile

SCHEMA = "hicache_mp.bench_storage/1"


def log(msg: str) -> None:
    print(msg, flush=True)


# --- page cache ------------------------------------------------------------------
def drop_cache(paths) -> str:
    """Drop the page cache for these files; returns the method that worked."""
    return coldcache.drop_cache(paths, machine_level=1)


def page_files(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        out.extend(os.path.join(d, f) for f in files if f.endswith(naming.PAGE_SUFFIX))
    return out


# --- raw ceilings ----------------------------------------------------------------
def _one_file(path: str, buf, write: bool, flags: int) -> None:
    """The workers' per-page pattern, bare: open, one pwritev/preadv of `buf`, close."""
    if write:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        os.pwritev(fd, [buf], 0)
    else:
        fd = os.open(path, os.O_RDONLY | flags)
        os.preadv(fd, [buf], 0)
    os.close(fd)


def raw_threads(paths: list[str], nbytes: int, threads: int, write: bool, direct: bool) -> float:
    """GB/s of `threads` plain threads each doing open + one preadv/pwritev + close per file."""
    flags = directio.O_DIRECT if direct else 0
    todo = list(paths)
    lock = threading.Lock()
    errors = []

    def run():
        buf = mmap.mmap(-1, nbytes)
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    p = todo.pop()
                try:
                    _one_file(p, buf, write, flags)
                except OSError as exc:
                    errors.append(exc)
                    return
        finally:
            buf.close()

    t0 = time.perf_counter()
    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    secs = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return len(paths) * nbytes / secs / 1e9


def raw_procs(paths: list[str], nbytes: int, procs: int, write: bool, direct: bool) -> float:
    """GB/s of `procs` plain processes, each doing open + one preadv/pwritev + close per
    file of its share: the workers' pattern without the engine (threads of one process
    share one address space and its locks; worker processes do not)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(procs + 1)
    flags = directio.O_DIRECT if direct else 0

    def run(share):
        buf = mmap.mmap(-1, nbytes)
        start.wait()
        try:
            for p in share:
                _one_file(p, buf, write, flags)
        except OSError as exc:
            print(f"raw process: {exc}", file=sys.stderr, flush=True)
            os._exit(1)
        os._exit(0)

    ps = [ctx.Process(target=run, args=(paths[i::procs],)) for i in range(procs)]
    for p in ps:
        p.start()
    start.wait()
    t0 = time.perf_counter()
    for p in ps:
        p.join()
    secs = time.perf_counter() - t0
    if any(p.exitcode for p in ps):
        raise OSError(f"a raw {'write' if write else 'read'} process failed (see above)")
    return len(paths) * nbytes / secs / 1e9


def raw_ceilings(paths: list[str], nbytes: int, counts: list[int], write: bool, direct: bool,
                 tag: str) -> dict:
    """Thread and process ceilings at each count, the page cache dropped before each:
    {"threads_N": GB/s, "procs_N": GB/s}."""
    verb = "pwritev" if write else "preadv"
    how = (" O_DIRECT" if direct else "") + ("" if write else " of the engine's files")
    out = {}
    for n in counts:
        for key, label, measure in (("threads", "threads", raw_threads),
                                    ("procs", "processes", raw_procs)):
            drop_cache(paths)
            gbps = measure(paths, nbytes, n, write, direct)
            log(f"{tag} raw {'write' if write else 'read'}: {n} {label} {verb}{how}: {gbps:.2f} GB/s")
            out[f"{key}_{n}"] = gbps
    return out


def raw_dd(directory: str, block: int, blocks: int, streams: int, write: bool) -> float | None:
    """GB/s of `streams` parallel dd processes with O_DIRECT, each on its own file."""
    if not shutil.which("dd"):
        return None
    per = max(1, blocks // streams)
    files = [os.path.join(directory, f"dd.{i}") for i in range(streams)]
    if write:
        cmds = [["dd", "if=/dev/zero", f"of={f}", f"bs={block}", f"count={per}", "oflag=direct",
                 "conv=fsync"] for f in files]
    else:
        cmds = [["dd", f"if={f}", "of=/dev/null", f"bs={block}", f"count={per}", "iflag=direct"]
                for f in files]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for c in cmds]
    errs = [p.communicate()[1] for p in procs]
    secs = time.perf_counter() - t0
    if any(p.returncode for p in procs):
        log(f"  dd failed ({errs[0].decode(errors='replace').strip().splitlines()[-1:]}); "
            f"dd ceiling skipped")
        return None
    return streams * per * block / secs / 1e9


# --- the engine --------------------------------------------------------------------
def store_spec(store: str, stripes: int) -> str:
    """The engine's storage_dir: `store` itself, or `stripes` directories under it
    (a striped store, workers.stripestore, here all on one device)."""
    return store if stripes == 1 else ",".join(os.path.join(store, f"s{i}") for i in range(stripes))


def make_engine(args, store: str, geometry: PageGeometry, workers: int,
                depth: int = 0, stripes: int = 1) -> PrefetchEngine:
    return PrefetchEngine(EngineConfig(
        storage_dir=store_spec(store, stripes), num_workers=workers, host_pool_pages=args.pool_pages,
        direct_io=args.direct_io, fsync=args.fsync, io_depth=depth,
        model_name="bench_storage",
        **({} if args.write_share is None else {"write_share": args.write_share})), geometry)


def run_ops(eng, kind: str, keys: list, slots: list, depth: int = 2) -> tuple[float, dict]:
    """Push every key through backup/prefetch in ops of len(slots)//depth pages, keeping
    `depth` ops in flight; returns (GB/s of pages that landed ok, status counts)."""
    size = max(1, len(slots) // depth)
    groups = [slots[i * size:(i + 1) * size] for i in range(depth)]
    start = getattr(eng, kind)
    in_flight = {}
    at = ok = 0
    counts: dict = {}
    t0 = time.perf_counter()
    while at < len(keys) or in_flight:
        for g in range(depth):
            op = in_flight.get(g)
            if op is not None and op.done:
                ok += op.ok_pages
                for k, v in op.status_counts().items():
                    counts[k] = counts.get(k, 0) + v
                del in_flight[g]
            if g not in in_flight and at < len(keys):
                batch = keys[at:at + size]
                in_flight[g] = start(batch, groups[g][:len(batch)])
                at += len(batch)
        if in_flight:
            eng.wait(next(iter(in_flight.values())), 0.05)
    secs = time.perf_counter() - t0
    return ok * eng.geometry.page_bytes / secs / 1e9, counts


def fill_pool(eng) -> None:
    """Random-looking bytes in every slot (written pages are not all zeros)."""
    mv = memoryview(eng.host_pool.segment.map)
    chunk = os.urandom(1 << 20)
    for off in range(0, len(mv), len(chunk)):
        n = min(len(chunk), len(mv) - off)
        mv[off:off + n] = chunk[:n]
    mv.release()


def mixed(args, store, geometry, workers, depth, read_keys, write_prefix, cache_method) -> dict:
    """Reads alone, then the same reads with a backup stream beside them, in
    turn `--mixed-repeats` times on one engine; the ratio is the median of the
    pairs' (with writes / alone). Buffered, the reads come from the page cache
    (`--mixed-cache warm`, what a server re-reading hot prefixes sees) or cold;
    with O_DIRECT they are cold whatever the flag. The writer rewrites the same
    keys over and over (every write is a real file write), so the disk holds
    one data set of them at most."""
    out = {"workers": workers, "io_depth": depth, "repeats": args.mixed_repeats}
    with make_engine(args, store, geometry, workers, depth) as eng:
        fill_pool(eng)
        warm = not eng.direct_io and args.mixed_cache == "warm"
        keys = read_keys * (args.mixed_passes if warm else 1)
        out["reads_from"] = "page cache" if warm else "device (cold)"
        out["passes"] = args.mixed_passes if warm else 1
        out["write_share"] = getattr(eng.config, "write_share", None)
        half = args.pool_pages // 2
        read_slots, write_slots = list(range(half)), list(range(half, 2 * half))
        wkeys = [f"{write_prefix}-{i}" for i in range(len(read_keys))]
        if warm:
            run_ops(eng, "prefetch", read_keys, read_slots)  # into the page cache
        out["io_depth"] = eng.config.resolved_io_depth(eng.direct_io)
        log(f"  mixed: {workers} workers x depth {out['io_depth']}, reads from the "
            f"{out['reads_from']}, write_share {out['write_share']}")
        rows = {"read_only": [], "read_with_writes": []}
        for _ in range(args.mixed_repeats):
            for label, with_writes in (("read_only", False), ("read_with_writes", True)):
                if not warm and cache_method:
                    drop_cache(page_files(store))
                stop = threading.Event()
                writer_result = {}
                if with_writes:
                    def writer():
                        # Run on a thread: its Python work is small (submit + poll under
                        # the engine's lock); the workers do the I/O.
                        done = 0
                        t0 = time.perf_counter()
                        while not stop.is_set():
                            at = done % len(wkeys)
                            batch = wkeys[at:at + len(write_slots)]
                            op = eng.backup(batch, write_slots[:len(batch)])
                            while not op.done:
                                eng.wait(op, 0.05)
                            done += len(batch)
                        writer_result["gbps"] = done * geometry.page_bytes / (
                            time.perf_counter() - t0) / 1e9
                        writer_result["pages"] = done

                    wt = threading.Thread(target=writer)
                    wt.start()
                gbps, counts = run_ops(eng, "prefetch", keys, read_slots)
                stop.set()
                if with_writes:
                    wt.join()
                rows[label].append({"read_gbps": gbps, "statuses": counts, **(
                    {"write_gbps": writer_result.get("gbps"),
                     "write_pages": writer_result.get("pages")} if with_writes else {})})
                log(f"  mixed {label:17s} reads {gbps:6.2f} GB/s"
                    + (f", writes beside them {writer_result.get('gbps', 0):.2f} GB/s"
                       if with_writes else ""))
    ratios = [w["read_gbps"] / r["read_gbps"] for r, w in
              zip(rows["read_only"], rows["read_with_writes"]) if r["read_gbps"]]
    out["runs"] = rows
    out["ratios"] = ratios
    out["ratio"] = statistics.median(ratios) if ratios else None
    for label in rows:  # the medians, under the names one run used to have
        med = statistics.median(r["read_gbps"] for r in rows[label])
        statuses: dict = {}
        for r in rows[label]:
            for k, v in r["statuses"].items():
                statuses[k] = statuses.get(k, 0) + v
        out[label] = {"read_gbps": med, "statuses": statuses}
    writes = [r["write_gbps"] for r in rows["read_with_writes"] if r.get("write_gbps")]
    out["read_with_writes"]["write_gbps"] = statistics.median(writes) if writes else None
    return out


def mixed_only(args, mode, geometry, base, npages, method) -> dict | None:
    """--mixed-only: write the data set once with the engine, then the mixed run."""
    store = os.path.join(base, f"store-{mode}")
    args.direct_io = mode
    tag = f"[direct_io={mode}]"
    try:
        make_engine(args, store, geometry, 1).close()
    except ValueError as exc:
        log(f"{tag} skipped: {exc}")
        return None
    top, depth = max(args.workers), args.io_depth[0]
    read_keys = [f"page-{i}" for i in range(npages)]
    try:
        with make_engine(args, store, geometry, top, depth) as eng:
            fill_pool(eng)
            wg, wc = run_ops(eng, "backup", read_keys, list(range(args.pool_pages)))
            log(f"{tag} {eng.direct_io_reason}; data set written at {wg:.2f} GB/s {wc}")
            out = {"direct_io": eng.direct_io, "direct_io_reason": eng.direct_io_reason}
        out["mixed"] = m = mixed(args, store, geometry, top, depth, read_keys, "mixed", method)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    out["ratios"] = {"mixed_read_over_read_only": m["ratio"]}
    log(f"{tag} mixed: read GB/s with writes / read-only, reads from the {m['reads_from']}: "
        f"{m['ratio']:.2f} (median of {len(m['ratios'])}: "
        f"{', '.join(f'{x:.2f}' for x in m['ratios'])}; "
        f"{m['read_with_writes']['read_gbps']:.2f} / {m['read_only']['read_gbps']:.2f} GB/s, "
        f"writes beside them {m['read_with_writes']['write_gbps'] or 0:.2f} GB/s)  "
        f"(target >= 0.80)")
    return out


# --- main ------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dir", default=None,
                   help="directory on the device to measure (a scratch subdirectory is made in "
                        "it and removed afterwards). Default: $TMPDIR or /tmp")
    p.add_argument("--workers", type=int, nargs="+", default=None,
                   help="worker counts to sweep (default: 1 2 4 8 and physical cores - 2; "
                        "--quick: 1 2)")
    p.add_argument("--total-gib", type=float, default=None,
                   help="data set size in GiB (default 12; --quick 0.0625). The disk needs about "
                        "3x this free (engine store, raw files, mixed writes)")
    p.add_argument("--num-layers", type=int, default=32, help="geometry: layers (Llama-3.1-8B)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="geometry: KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="geometry: head dim")
    p.add_argument("--page-size", type=int, default=64,
                   help="tokens per page; the defaults make 8 MiB pages")
    p.add_argument("--layout", default="page_first",
                   choices=("page_first", "layer_first", "page_first_direct"),
                   help="host pool layout")
    p.add_argument("--pool-pages", type=int, default=None,
                   help="host pool slots (default: 256, or what 2 GiB holds; --quick 32)")
    p.add_argument("--io-depth", type=int, nargs="+", default=None,
                   help="the engine's --hicache-mp-io-depth values to sweep at every worker "
                        "count, I/Os in flight per worker (default: 1 2 4; --quick: 1 2)")
    p.add_argument("--raw-threads", type=int, nargs="+", default=None,
                   help="thread (and process) counts of the raw preadv/pwritev ceilings; the "
                        "best counts (default: the largest --workers, and that times the "
                        "largest --io-depth)")
    p.add_argument("--dd-streams", type=int, default=None,
                   help="parallel dd processes of the dd ceiling (default: the largest --workers)")
    p.add_argument("--no-dd", action="store_true", help="skip the dd ceilings")
    p.add_argument("--direct-io", choices=DIRECT_IO_MODES, nargs="+", default=["on", "off"],
                   help="the engine's --hicache-mp-direct-io modes to measure, one full sweep "
                        "each (a mode the filesystem refuses is skipped, saying why); the raw "
                        "thread ceilings use O_DIRECT exactly when the engine does, dd always does")
    p.add_argument("--fsync", choices=FSYNC_MODES, default="none",
                   help="the engine's --hicache-mp-fsync for write-through")
    p.add_argument("--stripes", type=int, nargs="+", default=[1], metavar="N",
                   help="also run each sweep point with the store striped over N directories "
                        "(here on one device: the striping store's cost against 1)")
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed read+write run")
    p.add_argument("--mixed-only", action="store_true",
                   help="only the mixed run (no ceilings, no sweep): the data set is written "
                        "once with the largest --workers and the first --io-depth (default 0: "
                        "the engine's auto), then read alone and beside a backup stream")
    p.add_argument("--mixed-cache", choices=("warm", "cold"), default="warm",
                   help="buffered mixed reads: from the page cache (warm) or with it dropped "
                        "first (cold); with O_DIRECT they are cold anyway")
    p.add_argument("--mixed-repeats", type=int, default=3,
                   help="read-only / with-writes pairs, in turn; the ratio is their median")
    p.add_argument("--mixed-passes", type=int, default=1,
                   help="page-cache reads per measurement: the data set this many times (a "
                        "warm pass is short); cold reads pass once")
    p.add_argument("--write-share", type=float, default=None,
                   help="the engine's --hicache-mp-write-share (default: the engine's)")
    p.add_argument("--quick", action="store_true",
                   help="a small run for any machine (256 KiB pages, 64 MiB, workers 1 2): "
                        "checks that everything works, measures nothing worth quoting")
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.num_layers, args.num_kv_heads, args.head_dim = 4, 4, 64
        args.total_gib = args.total_gib or 1 / 16
        args.workers = args.workers or [1, 2]
        args.pool_pages = args.pool_pages or 32
        args.io_depth = args.io_depth or [1, 2]
    args.io_depth = args.io_depth or ([0] if args.mixed_only else [1, 2, 4])
    if min(args.io_depth) < (0 if args.mixed_only else 1):
        p.error("--io-depth values must be >= 1 (0, auto, with --mixed-only)")
    if args.mixed_repeats < 1 or args.mixed_passes < 1:
        p.error("--mixed-repeats and --mixed-passes must be >= 1")
    if min(args.stripes) < 1:
        p.error("--stripes values must be >= 1")
    args.total_gib = args.total_gib or 12.0
    if args.workers is None:
        top = auto_workers()
        args.workers = sorted({w for w in (1, 2, 4, 8) if w < top} | {top})
    return args


def sweep_mode(args, mode, geometry, base, npages, raw_write_dd, raw_read_dd, method) -> dict | None:
    """Everything that depends on the engine's I/O mode: thread ceilings, sweep, mixed."""
    page = geometry.page_bytes
    file_bytes = pagefile.HEADER_SIZE + page
    top = max(args.workers)
    threads = args.raw_threads or sorted({top, min(64, top * max(args.io_depth))})
    store, raw = os.path.join(base, f"store-{mode}"), os.path.join(base, f"raw-{mode}")
    os.makedirs(raw)
    args.direct_io = mode
    try:
        probe_engine = make_engine(args, store, geometry, 1)
    except ValueError as exc:
        log(f"[direct_io={mode}] skipped: {exc}")
        return None
    direct, why = probe_engine.direct_io, probe_engine.direct_io_reason
    probe_engine.close()
    out = {"direct_io": direct, "direct_io_reason": why}
    tag = f"[direct_io={mode}]"
    log(f"{tag} engine I/O: {why}")
    try:
        paths = [os.path.join(raw, f"p{i}") for i in range(npages)]
        out["raw_write"] = {"dd": raw_write_dd,
                            **raw_ceilings(paths, file_bytes, threads, True, direct, tag)}
        shutil.rmtree(raw, ignore_errors=True)
        sweep = []
        read_keys = [f"page-{i}" for i in range(npages)]
        for w in args.workers:
            for d in args.io_depth:
                for n in args.stripes:
                    shutil.rmtree(store, ignore_errors=True)
                    with make_engine(args, store, geometry, w, d, n) as eng:
                        fill_pool(eng)
                        slots = list(range(args.pool_pages))
                        wg, wc = run_ops(eng, "backup", read_keys, slots)
                        drop_cache(page_files(store))
                        rg, rc = run_ops(eng, "prefetch", read_keys, slots)
                    sweep.append({"workers": w, "io_depth": d, "stripes": n, "write_gbps": wg,
                                  "write_statuses": wc, "read_gbps": rg, "read_statuses": rc})
                    log(f"{tag} mp {w:3d} workers x depth {d}, {n} dir(s): write {wg:6.2f} GB/s "
                        f"{wc}   cold read {rg:6.2f} GB/s {rc}")
        out["sweep"] = sweep
        if len(args.stripes) > 1:
            out["stripes"] = _stripe_ratios(sweep, args.stripes, tag)
        if args.stripes[-1] != 1:  # the raw read ceiling and the mixed run use one directory
            shutil.rmtree(store, ignore_errors=True)
            with make_engine(args, store, geometry, max(args.workers), 1) as eng:
                fill_pool(eng)
                run_ops(eng, "backup", read_keys, list(range(args.pool_pages)))
        files = page_files(store)
        out["raw_read"] = {"dd": raw_read_dd,
                           **raw_ceilings(files, file_bytes, threads, False, direct, tag)}
        if not args.no_mixed:
            at_top = [r for r in sweep if r["workers"] == top]
            depth = max(at_top, key=lambda r: r["read_gbps"])["io_depth"]
            out["mixed"] = mixed(args, store, geometry, top, depth, read_keys, "mixed", method)
    finally:
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(raw, ignore_errors=True)
    raw_read = max(v for v in out["raw_read"].values() if v)
    raw_write = max(v for v in out["raw_write"].values() if v)
    best_r = max(sweep, key=lambda r: r["read_gbps"])
    best_w = max(sweep, key=lambda r: r["write_gbps"])
    out["ratios"] = r = {
        "read_over_raw": best_r["read_gbps"] / raw_read, "read_best_workers": best_r["workers"],
        "read_best_io_depth": best_r["io_depth"],
        "write_over_raw": best_w["write_gbps"] / raw_write, "write_best_workers": best_w["workers"],
        "write_best_io_depth": best_w["io_depth"],
        "mixed_read_over_read_only": out.get("mixed", {}).get("ratio"),
        "raw_read_gbps": raw_read, "raw_write_gbps": raw_write}
    log("")
    log(f"{tag} {'workers':>8} {'depth':>6} {'dirs':>5} {'write GB/s':>11} {'write/raw':>10} "
        f"{'read GB/s':>10} {'read/raw':>9}")
    for row in sweep:
        log(f"{tag} {row['workers']:>8} {row['io_depth']:>6} {row['stripes']:>5} "
            f"{row['write_gbps']:>11.2f} "
            f"{row['write_gbps'] / raw_write:>10.2f} {row['read_gbps']:>10.2f} "
            f"{row['read_gbps'] / raw_read:>9.2f}")
    log(f"{tag} raw ceilings (best of dd, threads and processes): read {raw_read:.2f} GB/s, "
        f"write {raw_write:.2f} GB/s")
    log(f"{tag} cold read / raw read (best, {r['read_best_workers']} workers x depth "
        f"{r['read_best_io_depth']}): "
        f"{r['read_over_raw']:.2f}  (target >= 0.90)")
    log(f"{tag} write / raw write (best, {r['write_best_workers']} workers x depth "
        f"{r['write_best_io_depth']}): "
        f"{r['write_over_raw']:.2f}  (target >= 0.90)")
    if r["mixed_read_over_read_only"] is not None:
        log(f"{tag} mixed: read GB/s with writes / read-only, reads from the "
            f"{out['mixed']['reads_from']} (median of {len(out['mixed']['ratios'])}): "
            f"{r['mixed_read_over_read_only']:.2f}  (target >= 0.80)")
    log("")
    return out


def _stripe_ratios(sweep: list, stripes: list, tag: str) -> dict:
    """GB/s over N directories / GB/s over one, per (workers, depth), and the
    geometric mean: on one device the difference is the seam's cost."""
    import math
    one = {(r["workers"], r["io_depth"]): r for r in sweep if r["stripes"] == 1}
    out = {}
    for n in stripes:
        if n == 1:
            continue
        rows = [(one[(r["workers"], r["io_depth"])], r) for r in sweep
                if r["stripes"] == n and (r["workers"], r["io_depth"]) in one]
        ratio = {k: math.exp(sum(math.log(b[f"{k}_gbps"] / a[f"{k}_gbps"]) for a, b in rows
                                 if a[f"{k}_gbps"] and b[f"{k}_gbps"]) / max(1, len(rows)))
                 for k in ("read", "write")}
        out[str(n)] = ratio
        log(f"{tag} {n} directories on this device / 1 (geometric mean over the sweep): "
            f"read {ratio['read']:.3f}, write {ratio['write']:.3f}  (target >= 0.97)")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    geometry = PageGeometry(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
                            head_dim=args.head_dim, page_size=args.page_size, layout=args.layout)
    page = geometry.page_bytes
    file_bytes = pagefile.HEADER_SIZE + page
    if args.pool_pages is None:
        args.pool_pages = max(8, min(256, (2 << 30) // page))
    npages = max(args.pool_pages, int(args.total_gib * (1 << 30)) // page)
    top = max(args.workers)
    streams = args.dd_streams or top
    modes = list(dict.fromkeys(args.direct_io))
    base = tempfile.mkdtemp(prefix="bench_storage.", dir=args.dir)
    report = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "command": sys.argv, "config": {k: v for k, v in vars(args).items() if k != "json"},
              "page_bytes": page, "file_bytes": file_bytes, "pages": npages,
              "dataset_bytes": npages * page, "directory": base, "modes": {}}
    report["config"]["direct_io"] = modes
    try:
        vfs = os.statvfs(base)
        need = 2 * npages * file_bytes + npages * file_bytes // 2
        if vfs.f_bavail * vfs.f_frsize < need:
            log(f"warning: {vfs.f_bavail * vfs.f_frsize / 1e9:.1f} GB free under {base}, the run "
                f"needs about {need / 1e9:.1f} GB; lower --total-gib")
        log(f"bench_storage: {npages} pages of {page / 2**20:.2f} MiB ({npages * page / 1e9:.2f} GB) "
            f"in {base}; workers {args.workers}; engine I/O modes {modes}")
        method = drop_cache([])
        report["cache_drop"] = method
        log(f"page cache dropped with {method} before every read pass")
        dd_w = dd_r = None
        if not args.no_dd and not args.mixed_only:
            ddir = os.path.join(base, "dd")
            os.makedirs(ddir)
            dd_w = raw_dd(ddir, file_bytes, npages, streams, True)
            if dd_w:
                log(f"raw write: {streams} x dd oflag=direct: {dd_w:.2f} GB/s")
                drop_cache([os.path.join(ddir, f) for f in os.listdir(ddir)])
                dd_r = raw_dd(ddir, file_bytes, npages, streams, False)
                if dd_r:
                    log(f"raw read: {streams} x dd iflag=direct: {dd_r:.2f} GB/s")
            shutil.rmtree(ddir, ignore_errors=True)
        report["raw_dd"] = {"write_gbps": dd_w, "read_gbps": dd_r, "streams": streams}
        for mode in modes:
            if args.mixed_only:
                out = mixed_only(args, mode, geometry, base, npages, method)
            else:
                out = sweep_mode(args, mode, geometry, base, npages, dd_w, dd_r, method)
            if out is not None:
                report["modes"][mode] = out
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        log(f"wrote {args.json}")
    return 0 if report["modes"] else 1


if __name__ == "__main__":
    sys.exit(main())
