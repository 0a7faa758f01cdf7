"""GPU check for the DeviceLoader: correctness on CUDA for both layouts, plus a load timeline.

Runs with a real engine, real worker processes and real files, like
tests/test_device_cpu.py, but on the GPU: random data, random page
permutations, partial ops, a poisoned device cache checked element by
element, and the round trip GPU -> host -> file -> host -> GPU. Then, with
Llama-3.1-8B pages (8 MiB), it prints when each batch of H2D copies was
issued and ran against when the op's pages landed from disk, and checks that
H2D of the early pages starts before the last page lands.

Exit status: 0 when every check passes, 1 otherwise. Holds no logic the
package needs.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch


from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from hicache_mp.device import DeviceLoader

POISON = 0x7BAD
LAYOUTS = ("page_first", "layer_first")
SMALL = (4, 2, 16, 8)          # layers, heads, dim, page size
LLAMA = (32, 8, 128, 64)       # Llama-3.1-8B, page 64: 8 MiB pages
failures: list[str] = []


def sync(device) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def check(ok: bool, what: str) -> None:
    print(("  ok    " if ok else "  FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def engine(store, shape, layout, pages, workers=2):
    g = PageGeometry(*shape, "bfloat16", layout)
    return PrefetchEngine(EngineConfig(storage_dir=store, num_workers=workers, host_pool_pages=pages), g)


def random_pages(g, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32767, (n, *g.page_shape), generator=gen, dtype=torch.int16).view(torch.bfloat16)


def poison(loader):
    for row in (loader.k_buffers, loader.v_buffers or []):
        for b in row:
            b.view(torch.int16).fill_(POISON)


def device_holds(loader, expected: dict) -> bool:
    """Every element: pages in `expected` bit-exact, every other element still poison."""
    P = loader.geometry.page_size
    rows = [loader.k_buffers] + ([loader.v_buffers] if loader.v_buffers is not None else [])
    want = [[torch.full_like(b, 0).view(torch.int16).fill_(POISON) for b in row] for row in rows]
    for d, page in expected.items():
        page = page.to(loader.device).view(torch.int16)
        for kv, row in enumerate(want):
            for layer, w in enumerate(row):
                w[d * P:(d + 1) * P] = page[kv, layer]
    return all(torch.equal(b.view(torch.int16), w) for row, wrow in zip(rows, want) for b, w in zip(row, wrow))


def write_device(loader, dev_pages, data):
    P = loader.geometry.page_size
    for d, page in zip(dev_pages, data):
        page = page.to(loader.device)
        for kv, row in enumerate([loader.k_buffers, loader.v_buffers]):
            for layer, b in enumerate(row):
                b[d * P:(d + 1) * P] = page[kv, layer]


def check_layout(layout: str, method: str, shape, rng, adopt: bool, device="cuda") -> None:
    """Partial op, then round trip GPU -> host -> file -> (other layout) host -> GPU."""
    n, pool, ndev = 24, 64, 40
    tag = f"{layout}/{method}/{'sglang-buffers' if adopt else 'fused'}/page={shape[3]}"
    with tempfile.TemporaryDirectory() as store:
        keys = [os.urandom(16).hex() for _ in range(n)]
        missing = int(rng.integers(1, n - 1))
        with engine(store, shape, layout, pool) as eng:
            g = eng.geometry
            kw = dict(num_device_pages=ndev)
            if adopt:  # SGLang's form: one tensor per layer, a spare page at the end
                tok = (ndev + 1) * g.page_size
                kw = dict(k_buffers=[torch.empty(tok, g.num_kv_heads, g.head_dim, dtype=torch.bfloat16,
                                                 device=device) for _ in range(g.num_layers)])
                kw["v_buffers"] = [torch.empty_like(b) for b in kw["k_buffers"]]
            if not adopt:
                kw["device"] = device
            with DeviceLoader(eng.host_pool, engine=eng, method=method, staging_pages=7, **kw) as loader:
                data = random_pages(g, n, seed=int(rng.integers(1 << 30)))
                # GPU -> host -> file, skipping one key so the read-back is partial.
                src = rng.permutation(ndev)[:n]
                poison(loader)
                write_device(loader, src, data)
                eng.host_pool.tensor.view(torch.int16).fill_(POISON)
                keep = [i for i in range(n) if i != missing]
                slots = rng.permutation(pool)[:n - 1]
                sh = loader.store(src[keep], slots, [keys[i] for i in keep])
                check(sh.wait(60) and sh.status == "ok", f"{tag}: store + backup of {n - 1} pages")
                host_ok = all(torch.equal(eng.host_pool.page_view(int(s)).view(torch.int16),
                                          data[i].view(torch.int16)) for s, i in zip(slots, keep))
                check(host_ok, f"{tag}: device -> host bytes exact")
                # file -> new host slots -> poisoned device: only the leading pages load.
                eng.host_pool.tensor.view(torch.int16).fill_(POISON)
                poison(loader)
                slots, dev = rng.permutation(pool)[:n], rng.permutation(ndev)[:n]
                op = eng.prefetch(keys, slots)
                h = loader.load(op, dev)
                check(h.wait(60) and op.status == "partial" and h.pages_loaded == missing,
                      f"{tag}: partial op loads its {missing} leading pages (got {h.pages_loaded}, {op.status})")
                sync(device)
                check(device_holds(loader, {int(dev[i]): data[i] for i in range(missing)}),
                      f"{tag}: partial load, every element of the device cache checked")
        # The other layout reads the same files: the full round trip.
        other = LAYOUTS[1 - LAYOUTS.index(layout)]
        with engine(store, shape, other, pool) as eng:
            with DeviceLoader(eng.host_pool, engine=eng, method=method, num_device_pages=ndev,
                              device=device) as loader:
                poison(loader)
                present = [i for i in range(n) if i != missing]
                slots, dev = rng.permutation(pool)[:n - 1], rng.permutation(ndev)[:n - 1]
                h = loader.load(eng.prefetch([keys[i] for i in present], slots), dev)
                check(h.wait(60) and h.status == "ok", f"{tag}: re-read under {other}")
                sync(device)
                check(device_holds(loader, {int(d): data[i] for d, i in zip(dev, present)}),
                      f"{tag}: round trip GPU -> host -> file -> host ({other}) -> GPU exact")


def timeline(layout: str, rng, pages: int) -> None:
    """Scheduler-style loop on Llama pages; H2D must start before the op's last page lands."""
    with tempfile.TemporaryDirectory() as store:
        keys = [f"tl-{i}" for i in range(pages)]
        with engine(store, LLAMA, layout, pages, workers=4) as eng:
            data = random_pages(eng.geometry, pages, seed=11)
            for s, page in enumerate(data):
                eng.host_pool.page_view(s).copy_(page)
            assert eng.wait(eng.backup(keys, range(pages)), 120)
        with engine(store, LLAMA, layout, pages, workers=4) as eng, \
                DeviceLoader(eng.host_pool, engine=eng, num_device_pages=pages, timing=True) as loader:
            poison(loader)
            slots, dev = rng.permutation(pages), rng.permutation(pages)
            t0 = time.perf_counter_ns()
            op = eng.prefetch(keys, slots)
            h = loader.load(op, dev)
            while not h.done:  # what a scheduler loop does
                eng.poll()
                loader.step()
            rows = loader.timeline(h)
            torch.cuda.synchronize()
            last_land = int(op.landed_ns.max())
            ms = lambda ns: (ns - t0) / 1e6  # noqa: E731
            print(f"\n  timeline {layout}: {pages} pages x 8 MiB, 4 workers, ms since prefetch()")
            print(f"    page 0 landed {ms(op.landed_ns[0]):8.2f}   last page landed {ms(last_land):8.2f}")
            shown = rows if len(rows) <= 8 else rows[:6] + [None] + rows[-1:]
            for r in shown:
                if r is None:
                    print(f"    ... {len(rows) - 7} more batches")
                    continue
                a, b = r["pages"]
                print(f"    H2D pages [{a:3d},{b:3d}) issued {ms(r['issue_ns']):8.2f}  gpu "
                      f"{ms(r['gpu_start_ns']):8.2f} -> {ms(r['gpu_end_ns']):8.2f}")
            first = rows[0]
            check(first["issue_ns"] < last_land and first["gpu_start_ns"] < last_land,
                  f"timeline {layout}: H2D of pages {first['pages']} ran at {ms(first['gpu_start_ns']):.2f} ms, "
                  f"before the last page landed at {ms(last_land):.2f} ms ({len(rows)} batches)")
            check(device_holds(loader, {int(d): data[i] for i, d in enumerate(dev)}),
                  f"timeline {layout}: all {pages} Llama pages exact on the device")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeline-pages", type=int, default=48,
                    help="pages in the op whose load timeline is printed (default: 48)")
    ap.add_argument("--seed", type=int, default=0, help="random data and page-order seed (default: 0)")
    ap.add_argument("--device", default="cuda", help="'cpu' dry-runs the checks on the CPU fallback")
    args = ap.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU fallback is covered by tests/test_device_cpu.py)")
        return 1
    rng = np.random.default_rng(args.seed)
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu (dry run of this script)"
    print(f"device: {name}  torch {torch.__version__}", flush=True)
    for layout in LAYOUTS:
        for method in ("auto", "memcpy", "gather"):
            for adopt in (False, True):
                check_layout(layout, method, SMALL, rng, adopt, args.device)
        check_layout(layout, "auto", (32, 8, 128, 16), rng, True, args.device)  # 2 MiB pages
    if args.device != "cpu":  # the timeline needs CUDA events
        for layout in LAYOUTS:
            timeline(layout, rng, args.timeline_pages)
    print(f"\n{'FAILED: ' + str(len(failures)) + ' check(s)' if failures else 'all checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
