"""What the weights' identity costs at start (decision 106): ms to fingerprint a model.

Lays a model directory of real written bytes (config.json and --files
safetensors files, --size in all; every byte written, no sparse file: a hole
reads as zeros without touching the disk) and times
`weights_fingerprint` on it, warm and cold, for each --readers count, and the
rule before decision 106 (three 64 KiB samples of each file) beside it:

  local   a directory under --dir (a local disk)
  jfs     a JuiceFS volume under --dir (hicache_mp.bench.jfs, as the
          scale-out tests start it: `file` object store, SQLite metadata):
          written through node 0, read through node 1, another client

Cold: after a sync, the kernel's page cache of the files read dropped by
posix_fadvise(DONTNEED) on each (on JuiceFS: the mount's files, the `file`
object store's and the cache directory's), or, with --drop-caches, the whole
machine's (`echo 3 > /proc/sys/vm/drop_caches`, where allowed); the report
says which. On JuiceFS also node 1's client is restarted with its cache
directory emptied, so its memory buffers and disk cache are cold too.
"disk" (JuiceFS only): node 1 restarted with its cache directory kept (the
blocks earlier reads left there) and the page cache dropped. Warm: the same
call again right after. Each figure is the median of --repeats runs (min and
max beside it), and every run's digest is checked against the first: the
rule is deterministic. "memo": a second call in one process on files
changed more than identity.RECENT_S ago.

  sudo python3 scripts/bench_identity.py --size 16G --files 4 --dir /var/tmp --where local jfs
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import struct
import sys
import time

import numpy as np

from hicache_mp.bench import coldcache
from hicache_mp.integrations.common import identity

CHUNK = 64 << 20


def log(msg: str) -> None:
    print(f"[bench_identity {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def lay_model(path: str, size: int, files: int) -> list:
    """config.json and `files` safetensors files of size/files bytes each (a
    JSON header of 64 tensors, then random bytes, all written)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "num_hidden_layers": 32}, f)
    block = np.random.default_rng(1).bytes(CHUNK)
    names = []
    each = size // files
    for i in range(files):
        name = os.path.join(path, f"model-{i + 1:05d}-of-{files:05d}.safetensors")
        tensors, per = {}, (each - (1 << 16)) // 64
        for t in range(64):
            tensors[f"model.layers.{i}.t{t}.weight"] = {
                "dtype": "BF16", "shape": [per // 2], "data_offsets": [t * per, (t + 1) * per]}
        header = json.dumps(tensors).encode()
        header += b" " * (-(8 + len(header)) % 8)
        with open(name, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            left = each - 8 - len(header)
            n = 0
            while left > 0:
                piece = block[:min(CHUNK, left)]
                f.write(struct.pack("<Q", n) + piece[8:])  # each chunk differs from the last
                left -= len(piece)
                n += 1
            f.flush()
            os.fsync(f.fileno())
        names.append(name)
    return names


def old_fingerprint(path: str) -> str:
    """The rule before decision 106: name, size and the first, middle and last
    64 KiB of each weight file (default readahead)."""
    sample = 64 << 10
    h = hashlib.sha256()
    for n in sorted(os.listdir(path)):
        f = os.path.join(path, n)
        size = os.path.getsize(f)
        h.update(f"{n}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for at in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
                fh.seek(at)
                h.update(fh.read(sample))
    return h.hexdigest()


def drop_cache(files, *, everything: bool = False) -> str:
    """Empty the kernel's page cache of `files`: fadvise(DONTNEED) on each,
    which leaves other processes' cache alone; with `everything`, the
    machine's `echo 3 > /proc/sys/vm/drop_caches` where allowed. Says how."""
    return coldcache.drop_cache(files, machine_level=3 if everything else None)


def files_under(top: str) -> list:
    return [os.path.join(d, n) for d, _, names in os.walk(top) for n in names]


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return (time.perf_counter() - t0) * 1e3, out


def measure(where: str, model: str, states: dict, readers_list, repeats: int) -> list:
    """Rows {where, cache, rule, readers, ms...} for this model directory.
    `states`: {cache state: a function that makes it and says how}; "warm"
    (no function) is right after a run of the same rule."""
    rows = []
    cases = [("new", r) for r in readers_list] + [("old", 1)]
    for rule, readers in cases:
        for cache in [*states, "warm"]:
            times, digests, how = [], set(), ""
            for _ in range(repeats):
                identity.forget()   # each run computes (the per-process memo is the next row)
                if cache in states:
                    how = states[cache]()
                else:   # warm: right after a run of the same rule
                    (identity.weights_fingerprint(model, readers=readers) if rule == "new"
                     else old_fingerprint(model))
                    identity.forget()
                ms, digest = timed(identity.weights_fingerprint, model, readers=readers) \
                    if rule == "new" else timed(old_fingerprint, model)
                times.append(ms)
                digests.add(digest)
            assert len(digests) == 1, f"{where} {rule}: the digest changed between runs"
            rows.append({"where": where, "cache": cache, "rule": rule, "readers": readers,
                         "ms": statistics.median(times), "min": min(times), "max": max(times),
                         "cold_by": how})
            log(f"{where:5} {cache:5} {rule} readers={readers:2}: {rows[-1]['ms']:9.1f} ms "
                f"(min {min(times):.1f}, max {max(times):.1f}) {rows[-1]['cold_by']}")
    # The per-process memo: a second call in one process, on settled files.
    time.sleep(identity.RECENT_S)
    identity.forget()
    identity.weights_fingerprint(model)
    ms, _ = timed(identity.weights_fingerprint, model)
    rows.append({"where": where, "cache": "memo", "rule": "new", "readers": identity.READERS,
                 "ms": ms, "min": ms, "max": ms, "cold_by": ""})
    log(f"{where:5} memo: {ms:.2f} ms (a second call in the same process, files settled)")
    return rows


def read_bytes(files) -> tuple[int, int]:
    """(bytes the new rule reads, bytes the files hold)."""
    total = sum(os.path.getsize(f) for f in files)
    got = 0
    for f in files:
        size = os.path.getsize(f)
        offs = identity.sample_offsets(size)
        got += size if size <= identity.STRIDE else len(offs) * identity.SAMPLE
    return got, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="16G", help="the model's bytes in all (16G)")
    ap.add_argument("--files", type=int, default=4,
                    help="weight files (4, as an 8B model's shards)")
    ap.add_argument("--dir", default="/var/tmp", help="where the model (and the JuiceFS volume) go")
    ap.add_argument("--where", nargs="+", default=["local"], choices=["local", "jfs"])
    ap.add_argument("--readers", type=int, nargs="+", default=[1, identity.READERS, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true",
                    help="cold by `echo 3 > /proc/sys/vm/drop_caches` (the whole machine's "
                         "page cache: other processes' too), not fadvise on the files read")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    size = parse_size(args.size)
    need = size * (3 if "jfs" in args.where else 1) + (1 << 30)
    free = shutil.disk_usage(args.dir).free
    if free < need:
        log(f"{args.dir} has {free / 2**30:.1f} GiB free; this run writes up to "
            f"{need / 2**30:.1f} GiB (the model, and on JuiceFS its bucket and cache too)")
        return 2
    rows = []
    base = os.path.join(args.dir, f"bench_identity.{os.getpid()}")
    os.makedirs(base)
    try:
        if "local" in args.where:
            model = os.path.join(base, "model")
            t0 = time.perf_counter()
            files = lay_model(model, size, args.files)
            got, total = read_bytes(files)
            log(f"local: laid {total / 2**30:.1f} GiB in {len(files)} files in "
                f"{time.perf_counter() - t0:.0f} s; the rule reads {got / 2**20:.1f} MiB of it")
            rows += measure("local", model,
                            {"cold": lambda: drop_cache(files, everything=args.drop_caches)},
                            args.readers, args.repeats)
            shutil.rmtree(model)
        if "jfs" in args.where:
            rows += run_jfs(base, size, args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n{'where':6} {'cache':5} {'rule':4} {'readers':>7} {'ms':>9} {'min':>9} "
          f"{'max':>9}  cold by")
    for r in rows:
        print(f"{r['where']:6} {r['cache']:5} {r['rule']:4} {r['readers']:7d} {r['ms']:9.1f} "
              f"{r['min']:9.1f} {r['max']:9.1f}  {r['cold_by']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "files": args.files, "rows": rows}, f, indent=1)
    return 0


def run_jfs(base: str, size: int, args) -> list:
    from hicache_mp.bench.jfs import Volume, unavailable
    why = unavailable()
    if why:
        log(f"jfs: skipped: {why}")
        return []
    os.makedirs(os.path.join(base, "jfs"))
    vol = Volume(os.path.join(base, "jfs"), nodes=2)
    try:
        t0 = time.perf_counter()
        lay_model(os.path.join(vol.mounts[0], "model"), size, args.files)
        log(f"jfs: laid through node 0 in {time.perf_counter() - t0:.0f} s")
        model = os.path.join(vol.mounts[1], "model")
        cache1 = os.path.join(vol.root, "cache1")

        def restart(empty: bool) -> str:
            """Node 1's client restarted (its cache directory emptied or kept),
            then the kernel's page cache of the FUSE files, the bucket's files
            (the object store) and the cache directory's files dropped."""
            vol.kill(1)
            if empty:
                for entry in os.listdir(cache1):
                    shutil.rmtree(os.path.join(cache1, entry), ignore_errors=True)
            vol.remount(1)
            files = [os.path.join(model, n) for n in sorted(os.listdir(model))]
            files += files_under(os.path.join(vol.root, "bucket")) + files_under(cache1)
            return (f"node 1 restarted, cache dir {'emptied' if empty else 'kept'}, "
                    + drop_cache(files, everything=args.drop_caches))
        # "disk": what a restarted server finds where the node's client read
        # the model before (JuiceFS keeps the blocks it read in its cache dir)
        return measure("jfs", model, {"cold": lambda: restart(True),
                                      "disk": lambda: restart(False)},
                       args.readers, args.repeats)
    finally:
        vol.close()


if __name__ == "__main__":
    sys.exit(main())
