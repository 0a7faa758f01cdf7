"""bench_vllm_capacity: this tier under `storage_max_bytes`, through vLLM's classes.

The capacity figure of the vLLM tier's set, beside scripts/bench_vllm_tier.py
(whose Rig and move() it drives: vLLM's CPU tier, tiers built by vLLM's
SecondaryTierFactory, TransferJobs polled once per scheduler step). One
hicache_mp tier with `storage_max_bytes` set to --limit-rows page files
stores --rounds rounds of --rows new keys each (more than the limit holds),
--gap-s of idle scheduler steps apart, while a thread samples the store's size on disk;
then the last round is loaded back and every byte checked. It reports the
limit, the peak and the final store size, the stores accepted per round
(pages written, and rows of jobs that fully succeeded: writes that would
cross the limit are dropped), pages evicted, store GB/s with the evictor at
work, and the last round's loaded rows and wrong bytes.
It measures and changes nothing; vLLM's fs tier has no limit, so no fs row.

    python scripts/bench_vllm_capacity.py --quick
    python scripts/bench_vllm_capacity.py --rows 512 --rounds 4 --limit-rows 768 --json c.json
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

from hicache_mp.bench.vllm.tier import ROW_8B, Rig, move, steps

HEADER = 4096  # a page file's header (workers/pagefile.py), before the row's bytes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512, help="new keys stored per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--limit-rows", type=int, default=768, help="storage_max_bytes, in page "
                   "files of one row each")
    p.add_argument("--row-bytes", type=int, default=ROW_8B)
    p.add_argument("--job-rows", type=int, default=32)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--eviction-interval-s", type=float, default=None,
                   help="the tier's evictor pass (default: the tier's own)")
    p.add_argument("--gap-s", type=float, default=1.0, help="idle steps between rounds "
                   "(the evictor's time to free room; 0: back to back)")
    p.add_argument("--store", default=None)
    p.add_argument("--phase-timeout-s", type=float, default=120.0)
    p.add_argument("--quick", action="store_true", help="small sizes: a CPU smoke run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.limit_rows, args.row_bytes, args.job_rows = 32, 48, 64 << 10, 4
        args.workers = args.workers or 2
    return args


def store_size(root: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # evicted while we looked
                pass
    return total


class Sampler(threading.Thread):
    """The store's size every 20 ms; the peak seen (with the size after each round)."""

    def __init__(self, root: str):
        super().__init__(daemon=True)
        self.root, self.peak, self.samples, self.done = root, 0, 0, threading.Event()

    def run(self):
        while not self.done.wait(0.02):
            self.peak = max(self.peak, store_size(self.root))
            self.samples += 1


def main(argv=None) -> int:
    args = parse_args(argv)
    import hicache_mp.integrations.vllm  # noqa: F401  (pins the vLLM version)
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    import numpy as np
    root = args.store or tempfile.mkdtemp(prefix="bench_vllm_capacity.")
    store = os.path.join(root, "capacity")
    n, limit = args.rows, args.limit_rows * (args.row_bytes + HEADER)
    rig = Rig(args.row_bytes, 2 * n)
    rig.view[:n] = np.random.default_rng(1).integers(0, 256, (n, args.row_bytes), np.uint8)
    cfg = {"type": "HiCacheMPTier", "module_path": "hicache_mp.integrations.vllm",
           "storage_dir": store, "num_workers": args.workers, "storage_max_bytes": limit}
    if args.eviction_interval_s is not None:
        cfg["eviction_interval_s"] = args.eviction_interval_s
    tier = SecondaryTierFactory.create_secondary_tier(cfg, rig.kv, rig.spec)
    sampler, rounds, src, dst = Sampler(store), [], list(range(n)), list(range(n, 2 * n))
    keys = []
    try:
        sampler.start()
        for r in range(args.rounds):
            rig.view[:n] += np.uint8(1)  # new bytes under new keys each round
            keys = [make_offload_key((5 << 40 | r << 20 | i).to_bytes(8, "big"), 0)
                    for i in range(n)]
            written = tier.metrics()["write_pages_ok"]
            got = move(tier, rig, args, keys, src, dst, False, False, 1 + r * (1 << 16))
            # A store job that is partly dropped reports no keys (vLLM keeps none of
            # it): the pages that landed are the engine's count.
            written = tier.metrics()["write_pages_ok"] - written
            rounds.append({"round": r, "store_gbps": written * args.row_bytes / got["seconds"]
                           / 1e9, "pages_written": written, "rows_ok": got["rows_ok"],
                           "seconds": got["seconds"], "capped": got["capped"],
                           "store_bytes_after": store_size(store)})
            print(json.dumps(rounds[-1]), flush=True)
            steps(tier, False, lambda: False, args.gap_s)  # the scheduler polls on meanwhile
        rig.view[n:2 * n] = 0
        load = move(tier, rig, args, keys, src, dst, False, True, 1 << 24)
        time.sleep(max(0.2, 2 * (args.eviction_interval_s or 0.1)))
        sampler.done.set()
        sampler.join()
        final, metrics = store_size(store), tier.metrics()
    finally:
        sampler.done.set()
        tier.drain_jobs()
        tier.shutdown()
        rig.close()
        if args.store is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            shutil.rmtree(store, ignore_errors=True)
    peak = max([sampler.peak, final] + [r["store_bytes_after"] for r in rounds])
    out = {"args": vars(args), "limit_bytes": limit, "written_bytes": args.rounds * n *
           (args.row_bytes + HEADER), "peak_store_bytes": peak,
           "peak_over_limit": peak / limit, "final_store_bytes": final,
           "samples": sampler.samples, "rounds": rounds,
           "last_round_load": load,
           "metrics": {k: metrics.get(k) for k in ("evicted_pages", "evicted_bytes",
                                                   "store_bytes_estimate", "evictor_respawns",
                                                   "write_pages_ok", "write_status", "index_pages")}}
    print(f"capacity: limit {limit / 2**20:.1f} MiB ({args.limit_rows} pages), written "
          f"{out['written_bytes'] / 2**20:.1f} MiB in {args.rounds} rounds of {n}; peak store "
          f"{peak / 2**20:.1f} MiB ({out['peak_over_limit']:.2f} of the limit, "
          f"{sampler.samples} samples); pages written per round "
          f"{[r['pages_written'] for r in rounds]} of {n} (rows of whole jobs "
          f"{[r['rows_ok'] for r in rounds]}); store GB/s "
          f"{[round(r['store_gbps'], 2) for r in rounds]}; evicted pages "
          f"{out['metrics']['evicted_pages']}; last round loaded {load['rows_ok']} of {n} rows, "
          f"wrong bytes {load['wrong_bytes']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 1 if load["wrong_bytes"] else 0


if __name__ == "__main__":
    sys.exit(main())
