"""Hybrid-model prefetch through SGLang 0.5.23's real host pools: `mp` against `file`.

A Qwen3-Next-like stack by default: full-attention KV pages (MHATokenToKVPoolHost)
plus one Mamba state per prefix (MambaPoolHost: fp32 temporal + bf16 conv
state, each its own memfd), both SGLang's own classes on the "shm" allocator
(scripts/sglang_real_hybrid.py). The backends are SGLang's `file`
(HiCacheFile) and hicache_mp (`HiCacheMP`, built by SGLang's
StorageBackendFactory from the dynamic config).

The calls are the ones SGLang's hybrid controller makes from its storage
threads (hybrid_cache_controller.py / cache_controller.py, 0.5.23):
backup = `batch_set_v2` for the Mamba state first, then the KV pages (mp:
`batch_set_v1`; file: `batch_set` of `get_data_page`s, the controller's
generic path for `file`); prefetch = per 128-page batch the KV pages (mp:
`batch_get_v1`; file: `batch_get` into dummy pages + `set_from_flat_data_page`),
then the trailing Mamba state with `batch_get_v2`, after a `batch_exists_v2`
hit query with the TRAILING_PAGES placeholder key. The prefetch runs on a
storage thread while the main thread is either idle (joins) or runs a
pure-Python busy loop (a scheduler building batches, holding the GIL). Not
SGLang's controller object itself: its hybrid variant needs a HostPoolGroup
and a device-side model; the call sequence and the pools are SGLang's.

Prints per backend and mode the prefetch GB/s (median of --runs) and the busy
ratio mp/file, and checks every page read byte for byte against the pages
written (wrong_pages must be 0). --json writes everything.

The GIL, two figures per prefetch round (their medians over --runs):
- GIL gaps (busy mode; idle: None): the busy loop stamps the time after
  every 256 iterations (~15 us of pure Python); a gap over 0.5 ms between
  two stamps means another thread held the GIL that long: Python work (or a
  C call that keeps the GIL) in the storage thread, such as a loop per page.
  Printed with the gap time.
- storage-thread blocks: the storage thread's voluntary context switches
  (/proc/self/task/<tid>/status), i.e. every time it slept: a blocking call
  (the wait for a batch), or, with a busy scheduler, taking the GIL back
  after giving it up (each torch op, large numpy op or blocking call gives
  it up; with the scheduler holding it, getting it back costs up to
  sys.getswitchinterval(), 5 ms). Busy minus idle counts those hand-offs.
  A hand-off is only seen from the side that waits, so the busy loop's gaps
  cannot count it: the storage thread takes the GIL for a few microseconds
  between two releases.
- scheduler preemptions (busy mode): the busy thread's involuntary context
  switches, the gaps that were the OS's and not the GIL's (a machine with
  fewer free cores than workers + 2).

    PYTHONPATH=. python3 scripts/sglang_hybrid_check.py --json $OUT/hybrid.json
    # small CPU smoke run:
    PYTHONPATH=. python3 scripts/sglang_hybrid_check.py --rounds 2 --prefix-pages 8 \
        --attn-layers 2 --mamba-layers 2 --kv-heads 2 --head-dim 64 --page-size 16 \
        --temporal 4,16,16 --conv 64,3 --runs 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import sglang_real_hybrid as RH  # noqa: E402

BATCH = 128   # SGLang's STORAGE_BATCH_SIZE
CHUNK = 256   # busy-loop iterations between two time stamps
GAP_S = 0.5e-3
# Every Rank's SGLang host pools live until the process ends. On CUDA they are
# cudaHostRegister'ed (alloc_with_host_register) and nothing here unregisters
# them: freeing one lets the next backend's pools be mapped at the same
# address, and registering that range again fails with cudaError 712
# (cudaErrorHostMemoryAlreadyRegistered).
_KEEP_POOLS: list = []


def log(msg: str) -> None:
    print(f"[sglang_hybrid_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ints(s: str) -> tuple:
    return tuple(int(x) for x in s.split(",") if x)


class Rank:
    """One rank's real host pools and one backend attached to them."""

    def __init__(self, S, hs, kind: str, store: str, args, seed: int):
        from sglang.srt.mem_cache.hicache_storage import PoolName
        self.kind, self.PoolName = kind, PoolName
        tokens = args.rounds * args.prefix_pages * args.page_size
        self.kv = RH.mha_pool(S, layout=args.kv_layout, layers=args.attn_layers,
                              heads=args.kv_heads, head_dim=args.head_dim,
                              page_size=args.page_size, tokens=tokens)
        self.mamba = RH.mamba_pool(S, layers=args.mamba_layers, slots=args.rounds,
                                   temporal=args.temporal, conv=(args.conv,))
        _KEEP_POOLS.extend((self.kv, self.mamba))
        g = torch.Generator().manual_seed(seed)
        RH.fill_random(self.kv, g)
        RH.fill_random(self.mamba, g)
        cfg = hs.HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
            model_name="hicache-mp/qwen3-next-like",
            extra_config={"backend_name": "hicache_mp", "class_name": "HiCacheMP",
                          "module_path": "hicache_mp.integrations.sglang", "interface_v1": 1,
                          "allocator": "shm", "storage_dir": store, "file_storage_path": store,
                          "num_workers": args.workers})
        if kind == "file":
            self.backend = hs.HiCacheFile(cfg)
        else:
            from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
            self.backend = StorageBackendFactory.create_backend("dynamic", cfg, self.kv)
        self.backend.register_mem_pool_host(self.kv)
        self.backend.register_mem_host_pool_v2(self.kv, PoolName.KV)
        self.backend.register_mem_host_pool_v2(self.mamba, PoolName.MAMBA)
        self.backend.on_host_pools_registered()
        self.P = args.page_size
        self.prefix_pages = args.prefix_pages

    def keys(self, r: int) -> list[str]:
        return [f"r{r}-p{i:05d}" for i in range(self.prefix_pages)]

    def pages(self, r: int) -> list[int]:
        return list(range(r * self.prefix_pages, (r + 1) * self.prefix_pages))

    def tokens(self, pages) -> torch.Tensor:
        P = self.P
        return (torch.tensor(pages, dtype=torch.int64)[:, None] * P
                + torch.arange(P)).reshape(-1)

    def mamba_t(self, key, slot, keys=None):
        return self.hs_transfer(self.PoolName.MAMBA, keys if keys is not None else [key],
                                torch.tensor([slot]) if slot is not None else None)

    def hs_transfer(self, name, keys, idx, policy=None):
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
        return PoolTransfer(name=name, keys=keys, host_indices=idx,
                            hit_policy=policy or PoolHitPolicy.TRAILING_PAGES)

    # --- the controller's calls --------------------------------------------------
    def backup(self, r: int) -> bool:
        keys, pages = self.keys(r), self.pages(r)
        side = self.backend.batch_set_v2([self.mamba_t(keys[-1], r)])
        ok = all(all(v) for v in side.values())
        for i in range(0, len(keys), BATCH):
            k, p = keys[i:i + BATCH], pages[i:i + BATCH]
            idx = self.tokens(p)
            if self.kind == "file":
                data = [self.kv.get_data_page(int(idx[j * self.P]), flat=True)
                        for j in range(len(k))]
                ok &= bool(self.backend.batch_set(k, data))
            else:
                ok &= all(self.backend.batch_set_v1(k, idx))
        return ok

    def prefetch(self, r: int) -> int:
        keys, pages = self.keys(r), self.pages(r)
        hit = self.backend.batch_exists_v2(keys, [self.mamba_t("x", None, keys=["x"])])
        n = hit.kv_hit_pages
        done = 0
        for i in range(0, n, BATCH):
            k, p = keys[i:min(i + BATCH, n)], pages[i:min(i + BATCH, n)]
            idx = self.tokens(p)
            if self.kind == "file":   # cache_controller._generic_page_get
                dummy = [self.kv.get_dummy_flat_data_page() for _ in k]
                got = self.backend.batch_get(k, dummy)
                c = 0
                for j, page in enumerate(got):
                    if page is None:
                        break
                    self.kv.set_from_flat_data_page(int(idx[j * self.P]), page)
                    c += 1
            else:
                res = self.backend.batch_get_v1(k, idx)
                c = res.index(False) if False in res else len(res)
            done += c
            if c < len(k):
                break
        if done == n and n:
            side = self.backend.batch_get_v2([self.mamba_t(keys[n - 1], r)])
            if not all(all(v) for v in side.values()):
                done = 0
        return done

    def page_bytes(self) -> int:
        d = self.kv.get_dummy_flat_data_page()
        m = self.mamba.get_dummy_flat_data_page()
        return d.numel() * d.element_size(), m.numel() * m.element_size()

    def close(self):
        if hasattr(self.backend, "close"):
            self.backend.close()


def wrong_pages(src: Rank, dst: Rank, rounds: int) -> int:
    bad = 0
    for r in range(rounds):
        for p in src.pages(r):
            a = src.kv.get_data_page(p * src.P).contiguous().view(torch.uint8)
            b = dst.kv.get_data_page(p * dst.P).contiguous().view(torch.uint8)
            bad += not torch.equal(a, b)
        bad += not torch.equal(src.mamba.get_data_page(r), dst.mamba.get_data_page(r))
    return bad


def context_switches(kind: str = "voluntary") -> int | None:
    """This thread's `kind` ("voluntary" or "nonvoluntary") context switches so
    far (Linux), else None."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            for line in f:
                if line.startswith(f"{kind}_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def busy_loop(worker: threading.Thread) -> tuple[int, int, float, int | None]:
    """The scheduler: pure Python until `worker` ends.
    (iterations, GIL gaps, gap seconds, times the OS preempted it)."""
    pre = context_switches("nonvoluntary")
    x, n, gaps, gap_s = 1, 0, 0, 0.0
    clock = time.perf_counter
    last = clock()
    while worker.is_alive():
        for i in range(CHUNK):
            x = (x * 1103515245 + i) & 0xFFFFFFFF
        n += CHUNK
        now = clock()
        if now - last > GAP_S:
            gaps += 1
            gap_s += now - last
        last = now
    post = context_switches("nonvoluntary")
    return n, gaps, gap_s, None if pre is None or post is None else post - pre


def clear_dst(dst: Rank) -> None:
    for t in (dst.kv.kv_buffer, dst.mamba.temporal_buffer, *dst.mamba.conv_buffer):
        t.zero_()


def run_backend(S, hs, kind: str, args, root: str) -> dict:
    store = os.path.join(root, kind)
    os.makedirs(store, exist_ok=True)
    src = Rank(S, hs, kind, store, args, seed=1)
    dst = Rank(S, hs, kind, store, args, seed=2)
    try:
        t0 = time.perf_counter()
        assert all(src.backup(r) for r in range(args.rounds)), f"{kind}: a backup failed"
        write_s = time.perf_counter() - t0
        kv_b, m_b = src.page_bytes()
        total = args.rounds * (args.prefix_pages * kv_b + m_b)
        out = {"write_s": write_s, "bytes_per_round_trip": total, "kv_page_bytes": kv_b,
               "mamba_state_bytes": m_b, "modes": {}}
        for mode in ("idle", "busy"):
            times, wrong, rates, handoffs, gap_times, blocks, preempt = [], 0, [], [], [], [], []
            for _ in range(args.runs):
                clear_dst(dst)
                done, switches = [], []

                def storage_thread():
                    v0 = context_switches()
                    done.extend(dst.prefetch(r) for r in range(args.rounds))
                    v1 = context_switches()
                    if v0 is not None and v1 is not None:
                        switches.append(v1 - v0)

                worker = threading.Thread(target=storage_thread)
                t0 = time.perf_counter()
                worker.start()
                if mode == "busy":
                    # the scheduler is the main thread: pure Python until the storage thread ends
                    n, gaps, gap_s, pre = busy_loop(worker)
                    if pre is not None:
                        preempt.append(pre / args.rounds)
                    rates.append(n / (time.perf_counter() - t0))
                    handoffs.append(gaps / args.rounds)
                    gap_times.append(gap_s / args.rounds)
                worker.join()
                dt = time.perf_counter() - t0
                assert done == [args.prefix_pages] * args.rounds, f"{kind} {mode}: hits {done}"
                times.append(dt)
                blocks.extend(n / args.rounds for n in switches)
                wrong += wrong_pages(src, dst, args.rounds)
            med = statistics.median(times)
            per_round = statistics.median(handoffs) if handoffs else None
            gap_ms = statistics.median(gap_times) * 1e3 if gap_times else None
            per_round_blocks = statistics.median(blocks) if blocks else None
            per_round_preempt = statistics.median(preempt) if preempt else None
            out["modes"][mode] = {"median_s": med, "gbps": total / med / 1e9, "runs_s": times,
                                  "wrong_pages": wrong,
                                  "loop_rate": statistics.median(rates) if rates else None,
                                  "gil_gaps_per_round": per_round,
                                  "gil_gap_ms_per_round": gap_ms,
                                  "storage_blocks_per_round": per_round_blocks,
                                  "scheduler_preemptions_per_round": per_round_preempt}
            gil = "GIL gaps/round None" if per_round is None else \
                f"GIL gaps/round {per_round:.1f} ({gap_ms:.1f} ms)"
            if per_round_blocks is not None:
                gil += f", storage-thread blocks/round {per_round_blocks:.1f}"
            if per_round_preempt is not None:
                gil += f", scheduler preempted/round {per_round_preempt:.1f}"
            log(f"{kind:5s} {mode:4s}: {total / med / 1e9:7.3f} GB/s  ({med:.3f} s for "
                f"{total / 2**20:.0f} MiB, wrong pages {wrong}, {gil})")
        if kind == "mp":
            out["metrics"] = {k: v for k, v in dst.backend.metrics().items()
                              if k.startswith("sidecar")}
        return out
    finally:
        src.close()
        dst.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="prefixes (one Mamba state each)")
    ap.add_argument("--prefix-pages", type=int, default=256, help="KV pages per prefix")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    ap.add_argument("--attn-layers", type=int, default=12, help="full-attention layers")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--kv-layout", default="page_first_direct",
                    choices=["layer_first", "page_first_direct", "page_first"])
    ap.add_argument("--mamba-layers", type=int, default=36, help="linear-attention layers")
    ap.add_argument("--temporal", type=ints, default=(32, 128, 128),
                    help="fp32 temporal state shape per layer")
    ap.add_argument("--conv", type=ints, default=(8192, 3), help="bf16 conv state shape per layer")
    ap.add_argument("--workers", type=int, default=8, help="mp workers for the KV pool")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--backends", default="mp,file")
    ap.add_argument("--store", default=None, help="store root (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    S = RH.load()
    import sglang.srt.mem_cache.hicache_storage as hs
    root = args.store or tempfile.mkdtemp(prefix="hicache_mp_hybrid_")
    log(f"store {root}; args {vars(args)}")
    res = {"args": {k: v for k, v in vars(args).items()}, "backends": {}}
    for kind in args.backends.split(","):
        res["backends"][kind] = run_backend(S, hs, kind, args, root)
    b = res["backends"]
    if "mp" in b and "file" in b:
        res["mp_over_file_busy"] = b["mp"]["modes"]["busy"]["gbps"] / b["file"]["modes"]["busy"]["gbps"]
        res["mp_over_file_idle"] = b["mp"]["modes"]["idle"]["gbps"] / b["file"]["modes"]["idle"]["gbps"]
        log(f"mp/file busy {res['mp_over_file_busy']:.1f}x, idle {res['mp_over_file_idle']:.1f}x "
            f"(target: busy >= 10x)")
    res["wrong_pages"] = sum(m["wrong_pages"] for r in b.values() for m in r["modes"].values())
    log(f"wrong pages: {res['wrong_pages']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    if not args.store:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    return res


if __name__ == "__main__":
    r = main()
    sys.exit(1 if r["wrong_pages"] else 0)
