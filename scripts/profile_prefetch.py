#!/usr/bin/env python
"""Profile prefetches under the reference scheduler: per-op phases, worker busy, a timeline.

Runs one backend of `hicache-mp bench` (same warm store, same loop), then prints
each prefetch op's queue wait / I/O time / drain / time until the scheduler saw
it (the counterpart of the alloc/io/copy lines in SGLang's log), the write-back
ops' rates, each worker's busy fraction, and writes a Chrome-trace JSON
(chrome://tracing or https://ui.perfetto.dev) of batches, ops and page
landings. Must not hold logic: hicache_mp.bench.sim.profile builds the figures.
With --device-load (default auto: when CUDA is available) each op's pages also
go to a device KV cache through DeviceLoader, and `h2d_ms` shows the time from
the op's last page landing until all its pages were on the device.

    python scripts/profile_prefetch.py --quick                      # mp
    python scripts/profile_prefetch.py --quick --backend file       # the starved thread
"""
import argparse
import json
import sys

from hicache_mp.bench.sim.bench import Bench, BenchConfig
from hicache_mp.bench.sim.profile import chrome_trace, format_breakdown, op_breakdown, phase_stats


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=("mp", "file", "file+yield"), default="mp",
                   help="which storage backend to profile")
    p.add_argument("--quick", action="store_true", help="the reduced-scale workload of --quick")
    p.add_argument("--num-requests", type=int, default=32, help="requests in the workload")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--hicache-mp-workers", type=int, default=0, help="mp workers; 0 = auto")
    p.add_argument("--hicache-storage-prefetch-policy", default="wait_complete",
                   choices=("best_effort", "wait_complete", "timeout"), help="prefetch policy")
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument("--hicache-mem-layout", default="page_first",
                   choices=("page_first", "layer_first"), help="host pool layout")
    p.add_argument("--storage-dir", default=None, help="page store (default: a temp dir)")
    p.add_argument("--scheduler-yield-ms", type=float, default=1.0,
                   help="sleep per loop iteration of the file+yield backend")
    p.add_argument("--device-load", choices=("auto", "on", "off"), default="auto",
                   help="load pages to a device KV cache (auto: when CUDA is available; "
                        "on: also the CPU fallback) and show H2D time per op")
    p.add_argument("--trace", default="prefetch_trace.json", help="Chrome-trace JSON to write")
    p.add_argument("--limit", type=int, default=40, help="ops to list one by one")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    bench = Bench(BenchConfig(
        runs=(a.backend,), num_requests=a.num_requests, seed=a.seed, quick=a.quick,
        page_size=a.page_size, layout=a.hicache_mem_layout, workers=a.hicache_mp_workers,
        policy=a.hicache_storage_prefetch_policy, yield_ms=a.scheduler_yield_ms,
        storage_dir=a.storage_dir, device_load=a.device_load))
    got = {}
    bench.run(on_result=lambda label, res, figs: got.update(res=res, figs=figs))
    res, figs = got["res"], got["figs"]
    print(f"\nPrefetch ops ({res.name}, policy {res.policy}), in submit order:")
    print(format_breakdown(op_breakdown(res.prefetch), limit=a.limit))
    bk = figs["backup"]
    print(f"\nWrite-back: {bk['ops']} ops, {bk['ok_pages']} pages, {bk['bytes'] / 1e6:.0f} MB, "
          f"mean {bk['gbps_mean'] or 0:.2f} GB/s per op, "
          f"mean op time {(bk['seconds_mean'] or 0) * 1e3:.1f} ms")
    busy = res.engine_metrics.get("worker_busy")
    if busy:
        print("Worker busy fraction (engine lifetime): " +
              ", ".join(f"w{i} {b:.1%}" for i, b in enumerate(busy)))
    else:
        print("Worker busy fraction: not reported by this backend (one in-process reader thread)")
    e = figs["extra"]
    print(f"Scheduler loop: {e['loop_iters_per_s']:.0f} it/s; mean TTFT "
          f"{figs['summary']['ttft_mean_s']:.3f} s")
    with open(a.trace, "w") as f:
        json.dump(chrome_trace(res), f)
    print(f"wrote {a.trace} (open in chrome://tracing or ui.perfetto.dev)", file=sys.stderr)
    with open(a.trace + ".phases.json", "w") as f:
        json.dump(phase_stats(op_breakdown(res.prefetch)), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
