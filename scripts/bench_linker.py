#!/usr/bin/env python3
"""SGLang's direct L3 path from files (issue 44, decision 101): hicache_mp's
linker loading a warm prefix into SGLang's device KV pool layer by layer,
beside load-everything-then-compute and beside sglang-fs-linker.

One run, interleaved rounds. Per round and per forward-time setting:
  layered   hicache_mp's linker with G layer groups (each G of `--groups`): T = start_layer_wise_loading
            to the end of a forward stand-in that, per layer, calls the counter's
            wait_until(l) and then runs a kernel reading layer l for t_compute
  whole     the same linker with one group: every layer read before layer 0 runs
            (load everything, then compute)
  fslinker  sglang-fs-linker 0.1.0 made to load on 0.5.23 (scripts/device/fs_linker_compat.py;
            only with --fs-linker and its wheel in .whl-fslinker/)
  busy      a pure-Python loop on the scheduler thread while the workers read
            the batch, over the same loop with no load in the same round
Reported beside T: bound = L * max(t_read_layer, t_compute) + t_read_layer, with
t_compute the forward's own time per layer, measured alone in the same cell, and
t_read_layer the fastest of the round's reads of the prefix (each group count's
and one group's, no copies) over L; and every loaded byte compared with the
stored one (wrong bytes, which must be 0).

The device pool is SGLang's MHATokenToKVPool on the GPU where it builds there,
else a stand-in with the same k_buffer/v_buffer tensors (the report says which);
the counter is SGLang's LayerWiseLoadCounter (hicache_mp's subclass).
Usage: python3 scripts/bench_linker.py [--pages 256 --layers 32 ...] [--json OUT]
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from hicache_mp.bench.sglang import real


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=256, help="prefix pages (256 x 8 MiB = 2 GiB)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--groups", default="8,16,32",
                   help="layer groups of the layered linker, comma-separated: each count is "
                        "a linker of its own, timed in the same rounds (the first one also "
                        "gives t_read and the busy loop)")
    p.add_argument("--workers", type=int, default=0, help="reader workers (0: auto)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compute", default="0.5,1,2",
                   help="forward time per layer, as multiples of t_read_layer")
    p.add_argument("--fs-linker", action="store_true",
                   help="also time sglang-fs-linker (scripts/device/fs_linker_compat.py must be "
                        "importable as fs_linker_compat: scripts/device on PYTHONPATH)")
    p.add_argument("--store", default=None, help="the store's parent directory (default: a temp dir)")
    p.add_argument("--json", default=None)
    return p.parse_args()


class StandInPool:
    """SGLang's MHATokenToKVPool's buffers where the class cannot be built here."""

    def __init__(self, tokens, layers, heads, dim, device):
        shape = (tokens, heads, dim)
        self.k_buffer = [torch.zeros(shape, dtype=torch.bfloat16, device=device)
                         for _ in range(layers)]
        self.v_buffer = [torch.zeros(shape, dtype=torch.bfloat16, device=device)
                         for _ in range(layers)]


class Alloc:
    def __init__(self, pool):
        self.pool = pool

    def get_kvcache(self):
        return self.pool


def device_pool(a, tokens, device):
    try:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        pool = MHATokenToKVPool(size=tokens, page_size=a.page_size, dtype=torch.bfloat16,
                                head_num=a.heads, head_dim=a.head_dim, layer_num=a.layers,
                                device=device, enable_memory_saver=False)
        return pool, "sglang MHATokenToKVPool"
    except Exception as exc:  # an SGLang import the box cannot satisfy
        print(f"bench_linker: SGLang's pool did not build here ({exc!r:.200}); stand-in buffers",
              file=sys.stderr)
        return StandInPool(tokens, a.layers, a.heads, a.head_dim, device), "stand-in buffers"


def params_for(pool, page_size):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    return CacheInitParams(disable=False, req_to_token_pool=None,
                           token_to_kv_pool_allocator=Alloc(pool), page_size=page_size)


class Args:
    model_path = "/models/bench-linker"


def make_linker(pool, a, store, groups, workers):
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
    extra = {"storage_dir": store, "layer_groups": groups, "load_pages": a.pages,
             "offload_pages": 64, "offload_workers": 2, "namespace": "bench-linker"}
    if workers:
        extra["num_workers"] = workers
    cfg = {"linker": "HiCacheMPLinker", "linker_module_path": "hicache_mp.integrations.sglang.linker",
           "linker_extra_config": extra}
    return create_unified_cache_linker(Args(), params_for(pool, a.page_size), backend="dynamic",
                                       config=cfg, components={ComponentType.FULL})


def make_fs_linker(pool, a, store):
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
    cfg = {"linker": "FsLinkerCompat", "linker_module_path": "fs_linker_compat",
           "linker_extra_config": {"directory": store, "namespace": "bench-linker"}}
    return create_unified_cache_linker(Args(), params_for(pool, a.page_size), backend="dynamic",
                                       config=cfg, components={ComponentType.FULL})


def transfers(keys, tokens):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    return [PoolTransfer(name=PoolName.KV, keys=list(keys), device_indices=tokens)]


def offload_all(link, keys, tokens, ps, chunk=64):
    for i in range(0, len(keys), chunk):
        part = keys[i:i + chunk]
        assert link.offload(transfers(part, tokens[i * ps:(i + len(part)) * ps]))
        deadline = time.monotonic() + 300
        while link.num_completed_offloads() == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("offload never completed")
            time.sleep(0.001)
        assert link.pop_completed_offload(), "offload failed"


class Forward:
    """Per layer: the counter's wait, then a kernel that reads layer l's rows of
    the request and runs for t_compute (torch.cuda._sleep, calibrated)."""

    def __init__(self, pool, layers, dst):
        self.pool, self.layers, self.dst = pool, layers, dst
        self.acc = torch.zeros((), dtype=torch.float32, device=dst.device)
        self.cycles_per_s = self._calibrate()

    @staticmethod
    def _calibrate():
        """Clock cycles a second, once the GPU's clock has ramped up (an idle GPU
        first runs slower, which would make every later kernel too short): the
        fastest of several timed sleeps after a warm-up. Each cell also times
        the forward alone, and the bound uses that measured time."""
        if not torch.cuda.is_available():
            return 0.0
        torch.cuda._sleep(400_000_000)
        torch.cuda.synchronize()
        best = 0.0
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = 50_000_000
            s.record()
            torch.cuda._sleep(n)
            e.record()
            e.synchronize()
            best = max(best, n / (s.elapsed_time(e) / 1e3))
        return best

    def alone(self, t_compute):
        """The forward with nothing to wait for: its own time (s)."""
        sync()
        t0 = time.perf_counter()
        self.run(Landed(), 0, t_compute)
        return time.perf_counter() - t0

    def run(self, counter, index, t_compute):
        if hasattr(counter, "set_consumer"):  # sglang-fs-linker's counter has none
            counter.set_consumer(index)
        cycles = int(t_compute * self.cycles_per_s)
        probe = self.dst[:: max(1, len(self.dst) // 4096)]
        for layer in range(self.layers):
            counter.wait_until(layer)
            if cycles:
                torch.cuda._sleep(cycles)
            self.acc += self.pool.k_buffer[layer][probe].float().sum()  # reads layer l
        sync()


class Landed:
    """A counter whose layers have all landed (the forward timed alone)."""

    def wait_until(self, layer):
        pass


def wrong_bytes(pool, layers, src, dst):
    bad = 0
    for layer in range(layers):
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            a, b = buf[src].view(torch.uint8), buf[dst].view(torch.uint8)
            bad += int((a != b).sum().item())
    return bad


def scramble(pool, layers, dst):
    for layer in range(layers):
        pool.k_buffer[layer][dst] = 0
        pool.v_buffer[layer][dst] = 0
    sync()


def timed_load(link, fwd, keys, dst, t_compute):
    """(T from start to the forward's end, landed) for one batch of `keys` into `dst`."""
    assert link.load("r", transfers(keys, dst))
    sync()
    t0 = time.perf_counter()
    index = link.start_layer_wise_loading()
    fwd.run(link.layer_done_counter, index, t_compute)
    t = time.perf_counter() - t0
    landed = link.finish_layer_wise_loading(index)
    return t, landed


def read_only(link, keys, groups):
    """The reader's time to read every group of `keys` (no copies): t_read."""
    reader = link.reader
    n = len(keys)
    t0 = time.perf_counter()
    ops = [reader.prefetch(keys, range(g * n, (g + 1) * n),
                           parts=[g] * n if groups > 1 else None) for g in range(groups)]
    for op in ops:
        reader.wait(op)
    t = time.perf_counter() - t0
    assert all(op.status == "ok" for op in ops), [op.status_counts() for op in ops]
    return t


def busy_rate(seconds, during=None):
    """A pure-Python loop's iterations per second for `seconds` (after `during()`)."""
    if during is not None:
        during()
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while True:
        n += 1
        if n % 4096 == 0 and time.perf_counter() >= end:
            break
    return n / (time.perf_counter() - t0)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def med(xs):
    return statistics.median(xs) if xs else None


def main():
    a = parse()
    real.import_stack()  # SGLang's imports where torchvision or kernel packages are missing
    cuda = torch.cuda.is_available()
    if not cuda:  # a smoke run of the logic; its timings mean nothing
        print("bench_linker: no GPU, a CPU smoke run (no figure to report)", file=sys.stderr)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    n, ps, L = a.pages, a.page_size, a.layers
    tokens = (2 * n + 1) * ps
    pool, pool_kind = device_pool(a, tokens, device)
    src = torch.arange(ps, (n + 1) * ps, device=device, dtype=torch.int64)
    dst = torch.arange((n + 1) * ps, (2 * n + 1) * ps, device=device, dtype=torch.int64)
    gen = torch.Generator(device=device).manual_seed(11)
    sync()
    for layer in range(L):
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            buf[src] = torch.randn(buf[src].shape, generator=gen, device=device).to(buf.dtype)
    sync()
    keys = [f"bench-{i:06d}" for i in range(n)]
    parent = tempfile.mkdtemp(prefix="bench_linker.", dir=a.store)
    # ServerArgs published as SGLang's own unit tests do (no server): sglang-fs-linker reads them
    from sglang.srt.runtime_context import get_context
    published = get_context().override_server_args(model_path=Args.model_path, page_size=ps)
    published.__enter__()
    groups = [int(g) for g in str(a.groups).split(",")]
    report = {"schema": "hicache_mp.bench_linker/2", "pages": n, "layers": L,
              "page_mib": 2 * L * ps * a.heads * a.head_dim * 2 / 2**20, "groups": groups,
              "pool": pool_kind, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "cpus": os.cpu_count(), "rounds": []}
    linkers, whole, fs = {}, None, None
    try:
        # Every linker reads the one store the first one writes, with as many
        # workers as the first one's auto sizing gave it: auto sizing would give
        # each later engine of this process fewer (one budget shared by all).
        layered = linkers[groups[0]] = make_linker(pool, a, os.path.join(parent, "mp"),
                                                   groups[0], a.workers)
        workers = a.workers or layered.reader.worker_count()
        report["workers"] = workers
        for g in groups[1:]:
            linkers[g] = make_linker(pool, a, os.path.join(parent, "mp"), g, workers)
        whole = make_linker(pool, a, os.path.join(parent, "mp"), 1, workers)
        t0 = time.perf_counter()
        offload_all(layered, keys, src, ps)
        report["offload_s"] = time.perf_counter() - t0
        assert layered.lookup("r", transfers(keys, None)) == list(range(1, n + 1))
        fwd = Forward(pool, L, dst)
        if a.fs_linker:
            fs = make_fs_linker(pool, a, os.path.join(parent, "fs"))
            t0 = time.perf_counter()
            fs.offload(transfers(keys, src))
            report["fs_offload_s"] = time.perf_counter() - t0
            while fs.num_completed_offloads():
                fs.pop_completed_offload()
        mults = [float(x) for x in a.compute.split(",")]
        for r in range(a.rounds):
            row = {"round": r}
            for g in groups:
                row[f"t_read_g{g}_s"] = read_only(linkers[g], keys, g)
            row["t_read_whole_s"] = read_only(whole, keys, 1)
            # the bound's read time: the fastest of this round's ways to read the prefix
            t_read = row["t_read_s"] = min(v for k, v in row.items() if k.startswith("t_read_"))
            t_rl = t_read / L
            row["busy_rate_idle"] = busy_rate(max(t_read, 0.05))
            for m in mults:
                tc = m * t_rl
                # the bound with the forward's own measured time per layer
                tc_real = fwd.alone(tc) / L
                cell = {"t_compute_layer_s": tc, "t_compute_layer_measured_s": tc_real,
                        "bound_s": L * max(t_rl, tc_real) + t_rl}
                order = [(f"g{g}", linkers[g]) for g in groups] + [("whole", whole)] + \
                    ([("fslinker", fs)] if fs else [])
                if r % 2:
                    order.reverse()
                for name, link in order:
                    scramble(pool, L, dst)
                    t, landed = timed_load(link, fwd, keys, dst, tc)
                    cell[name + "_s"] = t
                    cell[name + "_landed"] = landed
                    cell[name + "_wrong_bytes"] = wrong_bytes(pool, L, src, dst)
                for g in groups:
                    cell[f"g{g}_over_bound"] = cell[f"g{g}_s"] / cell["bound_s"]
                best = min(cell[f"g{g}_s"] for g in groups)
                cell["whole_over_best"] = cell["whole_s"] / best
                if fs:
                    cell["fslinker_over_best"] = cell["fslinker_s"] / best
                row[f"x{m:g}"] = cell
            # the busy loop while the workers read a batch (nothing of ours runs meanwhile)
            assert layered.load("b", transfers(keys, dst))
            holder = {}
            row["busy_rate_loading"] = busy_rate(
                max(t_read, 0.05), during=lambda: holder.update(i=layered.start_layer_wise_loading()))
            fwd.run(layered.layer_done_counter, holder["i"], 0)
            assert layered.finish_layer_wise_loading(holder["i"])
            row["busy_ratio"] = row["busy_rate_loading"] / row["busy_rate_idle"]
            report["rounds"].append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                              for k, v in row.items() if not isinstance(v, dict)}), flush=True)
        summarize(report, mults, groups)
    finally:
        for link in (*linkers.values(), whole, fs):
            if link is not None:
                link.close()
        shutil.rmtree(parent, ignore_errors=True)
        published.__exit__(None, None, None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def summarize(report, mults, groups):
    rounds = report["rounds"]
    out = {"t_read_s": med([r["t_read_s"] for r in rounds]),
           "t_read_whole_s": med([r["t_read_whole_s"] for r in rounds]),
           "busy_ratio": med([r["busy_ratio"] for r in rounds]),
           "busy_ratio_spread": [min(r["busy_ratio"] for r in rounds),
                                 max(r["busy_ratio"] for r in rounds)]}
    wrong = 0
    print(f"\n{report['device']}, {report['cpus']} CPUs, {report['pages']} pages x "
          f"{report['page_mib']:.1f} MiB, {report['layers']} layers, pool: {report['pool']}; "
          f"medians of {len(rounds)} rounds [min-max]; bound = L x max(t_read_layer, "
          f"t_compute) + t_read_layer, t_read the fastest read of the round")
    head = f"{'t_compute':>10} {'bound ms':>9}" + "".join(
        f" {f'{g} groups ms':>13} {'÷bound':>17}" for g in groups)
    print(head + f" {'whole ms':>9} {'÷best':>6} {'fs ms':>8} {'÷best':>6}")
    for m in mults:
        cells = [r[f"x{m:g}"] for r in rounds]
        for c in cells:
            wrong += sum(v for k, v in c.items() if k.endswith("_wrong_bytes"))
            if not all(v for k, v in c.items() if k.endswith("_landed")):
                wrong += 1 << 40  # a batch that did not land is a failure, said below
        row = {"bound_s": med([c["bound_s"] for c in cells]),
               "whole_s": med([c["whole_s"] for c in cells]),
               "whole_over_best": med([c["whole_over_best"] for c in cells])}
        line = f"{m:>9g}x {row['bound_s'] * 1e3:9.1f}"
        for g in groups:
            ratio = [c[f"g{g}_over_bound"] for c in cells]
            row[f"g{g}_s"] = med([c[f"g{g}_s"] for c in cells])
            row[f"g{g}_over_bound"] = med(ratio)
            row[f"g{g}_spread"] = [min(ratio), max(ratio)]
            line += (f" {row[f'g{g}_s'] * 1e3:13.1f} {med(ratio):6.3f} "
                     f"[{min(ratio):.2f}-{max(ratio):.2f}]")
        line += f" {row['whole_s'] * 1e3:9.1f} {row['whole_over_best']:6.2f}"
        if "fslinker_s" in cells[0]:
            row["fslinker_s"] = med([c["fslinker_s"] for c in cells])
            row["fslinker_over_best"] = med([c["fslinker_over_best"] for c in cells])
            line += f" {row['fslinker_s'] * 1e3:8.1f} {row['fslinker_over_best']:6.2f}"
        out[f"x{m:g}"] = row
        print(line)
    out["wrong_bytes"] = wrong
    print(f"t_read (the fastest read, no copies): {out['t_read_s'] * 1e3:.1f} ms, one group "
          f"{out['t_read_whole_s'] * 1e3:.1f} ms; busy loop while loading / idle: "
          f"{out['busy_ratio']:.3f} [{out['busy_ratio_spread'][0]:.3f}-"
          f"{out['busy_ratio_spread'][1]:.3f}]; wrong bytes or unlanded batches: {wrong}")
    report["summary"] = out


if __name__ == "__main__":
    main()
