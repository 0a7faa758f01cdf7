"""What sidecar checksums cost: batch_set_v2 / batch_get_v2 time of Mamba and SWA
pages with `sidecar_checksum` on (the default) and off, on SGLang's real host
pools (shm allocator: zero-copy; --staged: SGLang's default allocator).

    python scripts/bench_sidecar_checksum.py --store /tmp/ckbench [--big] [--staged]

Prints one line per pool and direction: seconds per batch off, on, and the
ratio on/off (median of --rounds). --big: Qwen3-Next-sized Mamba states
(~75 MiB a page; needs "sidecar_staging_bytes" over that with --staged) and
gpt-oss-sized SWA pages. Measures only; changes nothing.
"""
import argparse
import os
import shutil
import statistics
import sys
import time

import torch

from hicache_mp.bench.sglang import real_hybrid as real


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="/tmp/hicache_mp_ckbench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--staged", action="store_true")
    a = ap.parse_args(argv)
    S = real.load()
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageConfig, PoolName,
                                                      PoolTransfer)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    alloc = "default" if a.staged else "shm"
    mamba_kw = dict(layers=36, temporal=(32, 128, 128), conv=((8192, 3),), slots=4) if a.big \
        else dict(layers=8, temporal=(8, 64, 64), conv=((1024, 3),), slots=8)
    swa_kw = dict(layers=18, heads=8, head_dim=64, page_size=64, tokens=64 * 16) if a.big \
        else dict(layers=4, heads=4, head_dim=64, page_size=16, tokens=16 * 16)
    kv = real.mha_pool(S, layout="layer_first")
    pools = {"mamba": real.mamba_pool(S, allocator=alloc, **mamba_kw),
             "swa": real.mha_pool(S, layout="page_first", allocator=alloc, **swa_kw)}
    g = torch.Generator().manual_seed(0)
    for p in pools.values():
        real.fill_random(p, g)
    n_m, n_s = mamba_kw["slots"] // 2, swa_kw["tokens"] // swa_kw["page_size"] // 2
    times = {}
    for on in (False, True):
        shutil.rmtree(a.store, ignore_errors=True)
        extra = {"backend_name": "hicache_mp", "module_path": "hicache_mp.integrations.sglang",
                 "class_name": "HiCacheMP", "interface_v1": 1, "allocator": "shm",
                 "storage_dir": a.store, "sidecar_checksum": on,
                 "sidecar_staging_bytes": "1G"}
        cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=False,
                                   enable_storage_metrics=False, is_page_first_layout=False,
                                   model_name="ckbench", extra_config=extra)
        b = StorageBackendFactory.create_backend("dynamic", cfg, kv)
        b.register_mem_pool_host(kv)
        b.register_mem_host_pool_v2(kv, PoolName.KV)
        b.register_mem_host_pool_v2(pools["mamba"], PoolName.MAMBA)
        b.register_mem_host_pool_v2(pools["swa"], PoolName.SWA)
        b.on_host_pools_registered()
        try:
            for r in range(a.rounds):
                keys_m = [f"r{r}m{i}" for i in range(n_m)]
                keys_s = [f"r{r}s{i}" for i in range(n_s)]
                P = swa_kw["page_size"]
                tm = PoolTransfer(name=PoolName.MAMBA, keys=keys_m,
                                  host_indices=torch.arange(n_m, dtype=torch.int64))
                ts = PoolTransfer(name=PoolName.SWA, keys=keys_s,
                                  host_indices=torch.arange(n_s * P, dtype=torch.int64))
                back_m = PoolTransfer(name=PoolName.MAMBA, keys=keys_m,
                                      host_indices=torch.arange(n_m, 2 * n_m, dtype=torch.int64))
                back_s = PoolTransfer(name=PoolName.SWA, keys=keys_s, host_indices=torch.arange(
                    n_s * P, 2 * n_s * P, dtype=torch.int64))
                for name, t, back in (("mamba", tm, back_m), ("swa", ts, back_s)):
                    t0 = time.perf_counter()
                    ok = b.batch_set_v2([t])
                    t1 = time.perf_counter()
                    got = b.batch_get_v2([back])
                    t2 = time.perf_counter()
                    assert all(next(iter(ok.values()))) and all(next(iter(got.values()))), \
                        (name, ok, got)
                    times.setdefault((name, "set", on), []).append(t1 - t0)
                    times.setdefault((name, "get", on), []).append(t2 - t1)
        finally:
            b.close()
    shutil.rmtree(a.store, ignore_errors=True)
    print(f"path: {'staged' if a.staged else 'zero-copy'}; mamba {n_m} pages of "
          f"{pools['mamba'].get_size_per_token()} B, swa {n_s} pages per batch")
    for name in ("mamba", "swa"):
        for d in ("set", "get"):
            off = statistics.median(times[(name, d, False)])
            on = statistics.median(times[(name, d, True)])
            print(f"{name:6s} {d}: off {off * 1e3:8.2f} ms  on {on * 1e3:8.2f} ms  "
                  f"ratio on/off {on / off:5.2f}")
    for p in list(pools.values()) + [kv]:
        for fd in getattr(getattr(p, "allocator", None), "fds", []) or []:
            try:
                os.close(fd)
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
