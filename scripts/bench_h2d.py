"""H2D benchmark: DeviceLoader GB/s against torch pinned `copy_` GB/s, in the same run.

For each host layout, page-index pattern and batch size (default 1, 16, 128
pages of Llama-3.1-8B: 32 layers, 8 KV heads, 128 dims, bf16, page 64 = 8 MiB),
it times `loader.load_pages(host, device)` until its last event completes,
and a single `copy_(non_blocking=True)` of the same bytes from a pinned host
tensor into a device tensor, interleaved, and reports the medians and their
ratio. Patterns: `random` (unordered, non-contiguous pages on both sides, the
hard case) and `contiguous`. Also times the store direction (device -> host).

`run_h2d_bench(args) -> dict` is what other scripts call; `--json PATH` writes
the same dict. Holds no logic the package needs.
"""
import argparse
import json
import mmap
import os
import statistics
import sys
import time

import numpy as np
import torch


from hicache_mp import PageGeometry
from hicache_mp.device import DeviceLoader

TARGET = 0.85


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="page_first,layer_first",
                    help="comma-separated host layouts (default: both)")
    ap.add_argument("--batches", default="1,16,128",
                    help="comma-separated pages per load (default: 1,16,128)")
    ap.add_argument("--methods", default="auto,memcpy,gather",
                    help="copy methods: auto picks per batch; memcpy/gather force one (default: all three)")
    ap.add_argument("--patterns", default="random,contiguous",
                    help="page order on both sides: random (unordered, scattered) or contiguous (default: both)")
    ap.add_argument("--iters", type=int, default=10,
                    help="timed repetitions per cell, after a warm-up (default: 10)")
    ap.add_argument("--layers", type=int, default=32,
                    help="model layers (default: 32, Llama-3.1-8B)")
    ap.add_argument("--heads", type=int, default=8,
                    help="KV heads (default: 8)")
    ap.add_argument("--head-dim", type=int, default=128,
                    help="head dim (default: 128)")
    ap.add_argument("--page-size", type=int, default=64,
                    help="tokens per page (default: 64 -> 8 MiB pages)")
    ap.add_argument("--staging-pages", type=int, default=16,
                    help="device staging buffer, in pages (default: 16)")
    ap.add_argument("--no-store", action="store_true", help="skip the device -> host direction")
    ap.add_argument("--explore", action="store_true",
                    help="also time the raw pieces (DMA, zero-copy gathers, device scatter) for 128 random pages")
    ap.add_argument("--device", default="cuda", help="'cpu' dry-runs the script logic (numbers are meaningless)")
    ap.add_argument("--json", default=None, help="write the result dict here")
    return ap.parse_args(argv)


class _AnonPool:
    """A pool in anonymous memory, for machines whose /dev/shm is too small (same API for the loader)."""

    def __init__(self, g, num_pages):
        self.geometry, self.num_pages = g, num_pages
        self._map = mmap.mmap(-1, g.pool_bytes(num_pages))
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8).view(
            getattr(torch, g.dtype)).view(g.pool_shape(num_pages))

    def close(self):
        self.tensor = None


def _make_pool(g, num_pages):
    try:
        from shm import HostPool, new_owner_tag
        return HostPool(g, num_pages, name=new_owner_tag() + ".bench", create=True), "shm"
    except Exception as exc:  # no posix_ipc or no room in /dev/shm: same bytes, anonymous memory
        print(f"[bench_h2d] shm pool unavailable ({exc}); using anonymous memory", file=sys.stderr)
        return _AnonPool(g, num_pages), "anonymous"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_s(fn, iters):
    fn()  # warm-up: allocations, index caches, first-touch
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _indices(pattern, n, pool_pages, dev_pages, rng):
    if pattern == "contiguous":
        return np.arange(n), np.arange(n)
    return rng.choice(pool_pages, n, replace=False), rng.choice(dev_pages, n, replace=False)


def _explore(loader, g, pool_pages, dev_pages, n, iters, rng) -> dict:
    """Raw pieces for n random pages, GB/s of page bytes: where the loader's time goes."""
    host = torch.from_numpy(rng.choice(pool_pages, n, replace=False)).cuda()
    dev = torch.from_numpy(rng.choice(dev_pages, n, replace=False)).cuda()
    m4, stage = loader._mapped4, torch.empty((n, g.kv_count, g.num_layers, loader._W),
                                            dtype=loader._word, device="cuda")
    nbytes = n * g.page_bytes
    out = {}

    def timed(name, fn):
        def run():
            fn()
            torch.cuda.synchronize()
        out[name] = round(nbytes / _median_s(run, iters) / 1e9, 2)

    if m4 is not None:
        timed("zero_copy_gather_one_kernel", lambda: torch.index_select(m4, 0, host, out=stage))
        per = stage.view(g.num_layers, n, g.kv_count, loader._W)
        timed("zero_copy_gather_per_layer", lambda: [torch.index_select(m4[:, :, l], 0, host, out=per[l])
                                                    for l in range(g.num_layers)])
        timed("zero_copy_advanced_index", lambda: stage.copy_(m4[host]))
    if g.layout == "page_first":
        h4 = loader._host4
        timed("dma_per_page_8MiB", lambda: [stage[i].copy_(h4[j], non_blocking=True)
                                           for i, j in enumerate(host.tolist())])
    if loader._fused is not None:
        timed("device_scatter_fused", lambda: loader._fused.index_copy_(2, dev, stage.permute(1, 2, 0, 3)))
        timed("device_scatter_per_layer", lambda: [loader._fused[:, l].index_copy_(1, dev, stage[:, :, l].transpose(0, 1))
                                                  for l in range(g.num_layers)])
    print(f"explore {g.layout}: {out}", flush=True)
    return out


def run_h2d_bench(args) -> dict:
    """Run the benchmark; `args` is an argparse.Namespace from parse_args() (or look-alike)."""
    device = getattr(args, "device", "cuda")
    if device != "cpu" and not torch.cuda.is_available():
        raise RuntimeError("bench_h2d needs CUDA (or --device cpu for a dry run)")
    batches = [int(b) for b in str(args.batches).split(",")]
    max_batch = max(batches)
    pool_pages = dev_pages = 2 * max_batch  # room for random, non-contiguous picks
    rng = np.random.default_rng(0)
    result = {"device": torch.cuda.get_device_name() if device != "cpu" else "cpu", "torch": torch.__version__, "rows": [],
              "target_ratio": TARGET}
    for layout in args.layouts.split(","):
        g = PageGeometry(args.layers, args.heads, args.head_dim, args.page_size, "bfloat16", layout)
        pool, kind = _make_pool(g, pool_pages)
        result["pool"] = kind
        result["page_bytes"] = g.page_bytes
        try:
            pool.tensor.view(torch.int16).fill_(0x1234)  # the bytes do not matter to bandwidth
            pinned = torch.empty(max_batch * g.page_bytes, dtype=torch.uint8, pin_memory=device != "cpu")
            target = torch.empty_like(pinned, device=device)
            for method in args.methods.split(","):
                with DeviceLoader(pool, device=device, num_device_pages=dev_pages, method=method,
                                  staging_pages=args.staging_pages) as loader:
                    result.setdefault("can_gather", loader.can_gather)
                    if getattr(args, "explore", False) and method == "auto" and device != "cpu":
                        result.setdefault("explore", {})[layout] = _explore(loader, g, pool_pages, dev_pages,
                                                                            max_batch, args.iters, rng)
                    for pattern in args.patterns.split(","):
                        for n in batches:
                            host, dev = _indices(pattern, n, pool_pages, dev_pages, rng)
                            nbytes = n * g.page_bytes
                            src, dst = pinned[:nbytes], target[:nbytes]

                            def pinned_h2d():
                                dst.copy_(src, non_blocking=True)
                                _sync()

                            def loader_h2d():
                                loader.load_pages(host, dev).wait()

                            def pinned_d2h():
                                src.copy_(dst, non_blocking=True)
                                _sync()

                            def loader_d2h():
                                loader.store(dev, host).wait()

                            todo = [("load", loader_h2d, pinned_h2d)]
                            if not args.no_store:
                                todo.append(("store", loader_d2h, pinned_d2h))
                            for direction, mine, ref in todo:
                                t_ref = _median_s(ref, args.iters)
                                t_mine = _median_s(mine, args.iters)
                                row = {"layout": layout, "method": method, "pattern": pattern,
                                       "direction": direction, "pages": n, "bytes": nbytes,
                                       "loader_gbps": nbytes / t_mine / 1e9,
                                       "pinned_gbps": nbytes / t_ref / 1e9}
                                row["ratio"] = row["loader_gbps"] / row["pinned_gbps"]
                                result["rows"].append(row)
                                print(f"{layout:11s} {method:6s} {pattern:10s} {direction:5s} {n:4d} pages "
                                      f"loader {row['loader_gbps']:6.1f} GB/s  pinned copy_ "
                                      f"{row['pinned_gbps']:6.1f} GB/s  ratio {row['ratio']:.3f}", flush=True)
            del pinned, target
        finally:
            pool.close()
    big = [r for r in result["rows"] if r["method"] == "auto" and r["direction"] == "load"
           and r["pages"] == max_batch]
    result["target_met"] = bool(big) and all(r["ratio"] >= TARGET for r in big)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run_h2d_bench(args)
    print(f"\n{max(int(b) for b in args.batches.split(','))}-page loads (method auto) at >= {TARGET} x "
          f"pinned copy_: {'yes' if result['target_met'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
