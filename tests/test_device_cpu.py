"""DeviceLoader on the CPU fallback: real engine, real worker processes, real files.

Every check compares every element of the device KV cache: loaded pages must
hold exactly the stored bytes, every other element must still hold the poison.
The CUDA path runs the same checks through scripts/device/gpu_check_device.py.

Reaches inside: the loader's `_fused` (None: adopted per-layer buffers take
the per-layer copy path, not the fused one; which path runs has no public
query) and `_advance_all` (the look at every load that a step with nothing
new skips: the test times it against step(), decision 83).
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from hicache_mp.device import DeviceLoader

LAYOUTS = ["page_first", "layer_first"]
METHODS = ["auto", "memcpy", "gather"]
POISON = 0x7BAD  # as int16 bits: a bf16 value no random page contains by accident here
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_engine(store, layout, pages=64, mla=False):
    g = PageGeometry(4, 2, 16, 8, "bfloat16", layout, mla=mla)
    return PrefetchEngine(EngineConfig(storage_dir=store, num_workers=2, host_pool_pages=pages), g)


@pytest.fixture(scope="module")
def module_engines(tmp_path_factory):
    """The module's engines on one store, one per (layout, role), shared by its
    tests: each ends with its ops done and its loader closed, so the next
    finds an engine as a fresh one but for pages under other tests' keys. A
    layout's "reader" reads what a "writer" stored: another engine, through
    the page files. (Started once: 4 engines, not 2 for each round trip.)"""
    store = str(tmp_path_factory.mktemp("device"))
    made = {(layout, role): make_engine(store, layout)
            for layout in LAYOUTS for role in ("writer", "reader")}
    yield made
    for eng in made.values():
        eng.close()


@pytest.fixture
def engines(module_engines):
    """engines(layout, role="writer"): a module engine, found idle after the test."""
    yield lambda layout, role="writer": module_engines[layout, role]
    for (layout, role), eng in module_engines.items():
        assert eng.metrics()["ops_in_flight"] == 0, f"the {layout} {role} was left busy"


def random_pages(g, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *g.page_shape), generator=gen).to(torch.bfloat16)


def device_page(loader, d):
    """Device page d as [kv, layer, token, head, dim], like a host page view."""
    P = loader.geometry.page_size
    rows = [loader.k_buffers] + ([loader.v_buffers] if loader.v_buffers is not None else [])
    return torch.stack([torch.stack([b[d * P:(d + 1) * P] for b in row]) for row in rows])


def poison(loader):
    for row in (loader.k_buffers, loader.v_buffers or []):
        for b in row:
            b.view(torch.int16).fill_(POISON)


def assert_device_holds(loader, expected: dict):
    """Pages in `expected` (device page -> page tensor) match bit for bit; all else is poison."""
    for d in range(loader.num_device_pages):
        got = device_page(loader, d).view(torch.int16)
        if d in expected:
            assert torch.equal(got, expected[d].view(torch.int16)), f"device page {d} differs"
        else:
            assert bool((got == POISON).all()), f"device page {d} was written but should not be"


def backup(eng, keys, slots, data):
    for slot, page in zip(slots, data):
        eng.host_pool.page_view(int(slot)).copy_(page)
    op = eng.backup(keys, slots)
    assert eng.wait(op, 30) and op.status == "ok", op


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_op_loads_only_leading_pages(engines, layout, method):
    rng = np.random.default_rng(hash((layout, method)) % 2**32)
    n, missing = 24, 17
    keys = [os.urandom(16).hex() for _ in range(n)]
    eng = engines(layout)
    data = random_pages(eng.geometry, n, seed=1)
    present = [i for i in range(n) if i != missing]
    backup(eng, [keys[i] for i in present], rng.permutation(64)[:n - 1], data[present])
    eng.host_pool.tensor.view(torch.int16).fill_(POISON)
    with DeviceLoader(eng.host_pool, device="cpu", num_device_pages=40, engine=eng,
                      method=method, staging_pages=5) as loader:
        poison(loader)
        slots = rng.permutation(64)[:n]
        dev = rng.permutation(40)[:n]
        op = eng.prefetch(keys, slots)
        h = loader.load(op, dev)
        assert h.wait(30)
        assert op.status == "partial" and op.completed_pages == missing
        assert h.pages_loaded == missing and h.done and h.status == "partial"
        assert op.device_event is h
        assert_device_holds(loader, {int(dev[i]): data[i] for i in range(missing)})


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("read_layout", LAYOUTS)
@pytest.mark.parametrize("write_layout", LAYOUTS)
def test_round_trip_device_host_file_host_device(engines, write_layout, read_layout, method):
    rng = np.random.default_rng(7)
    n = 20
    keys = [f"rt-{write_layout}-{read_layout}-{method}-{i}" for i in range(n)]
    eng = engines(write_layout)
    with DeviceLoader(eng.host_pool, device="cpu", num_device_pages=32, engine=eng,
                      method=method, staging_pages=6) as loader:
        data = random_pages(eng.geometry, n, seed=2)
        src_dev = rng.permutation(32)[:n]
        poison(loader)
        for d, page in zip(src_dev, data):
            for kv, row in enumerate([loader.k_buffers, loader.v_buffers]):
                for layer, b in enumerate(row):
                    b[d * 8:(d + 1) * 8] = page[kv, layer]
        eng.host_pool.tensor.view(torch.int16).fill_(POISON)
        slots = rng.permutation(64)[:n]
        sh = loader.store(src_dev, slots, keys)
        assert sh.wait(30) and sh.status == "ok" and sh.backup_op.status == "ok"
        for slot, page in zip(slots, data):  # device -> host landed exactly
            assert torch.equal(eng.host_pool.page_view(int(slot)).view(torch.int16), page.view(torch.int16))
    eng = engines(read_layout, "reader")
    with DeviceLoader(eng.host_pool, device="cpu", num_device_pages=48, engine=eng,
                      method=method, staging_pages=6) as loader:
        eng.host_pool.tensor.view(torch.int16).fill_(POISON)
        poison(loader)
        slots = rng.permutation(64)[:n]  # new host slots, new device pages
        dev = rng.permutation(48)[:n]
        h = loader.load(eng.prefetch(keys, slots), dev)
        assert h.wait(30) and h.status == "ok" and h.pages_loaded == n
        assert_device_holds(loader, {int(d): data[i] for i, d in enumerate(dev)})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_incremental_issue_follows_completed_pages(engines, layout):
    """step() issues exactly the pages that newly landed, honouring min_step_pages."""
    eng = engines(layout)
    with DeviceLoader(eng.host_pool, device="cpu", num_device_pages=16, timing=True) as loader:
        data = random_pages(eng.geometry, 10, seed=3)
        slots = np.array([9, 3, 4, 5, 0, 1, 2, 7, 8, 6])
        for slot, page in zip(slots, data):
            eng.host_pool.page_view(int(slot)).copy_(page)
        poison(loader)
        op = _SteppedOp(slots)
        dev = np.array([15, 2, 3, 4, 10, 11, 0, 1, 7, 5])
        h = loader.load(op, dev, min_step_pages=3)
        assert h.issued == 0 and not h.done
        for landed, want in [(2, 0), (3, 3), (4, 3), (9, 9), (10, 9)]:
            op.completed_pages = landed
            loader.step()
            assert h.issued == want, (landed, h.issued)
        op.done = True  # the op's tail arrives below min_step_pages: still issued
        loader.step()
        assert h.issued == 10 and h.done and h.pages_loaded == 10
        assert [b[:2] for b in h.batches] == [(0, 3), (3, 9), (9, 10)]
        assert_device_holds(loader, {int(d): data[i] for i, d in enumerate(dev)})
        assert h.layer_event(0).query()
        h.wait_layer(3)  # no-op on the CPU, must not raise


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adopted_sglang_buffers_and_mla(store, layout):
    """Per-layer tensors the caller owns (no fused view), and a one-buffer MLA geometry."""
    for mla in (False, True):
        with make_engine(store, layout, mla=mla) as eng:
            g = eng.geometry
            tokens = 12 * g.page_size + g.page_size  # SGLang keeps one spare page
            k = [torch.empty(tokens, g.num_kv_heads, g.head_dim, dtype=torch.bfloat16) for _ in range(4)]
            v = None if mla else [torch.empty_like(b) for b in k]
            with DeviceLoader(eng.host_pool, k_buffers=k, v_buffers=v, engine=eng) as loader:
                assert loader._fused is None and loader.num_device_pages == 13
                poison(loader)
                data = random_pages(g, 5, seed=4)
                for slot, page in zip([60, 2, 33, 34, 35], data):
                    eng.host_pool.page_view(slot).copy_(page)
                h = loader.load_pages([60, 2, 33, 34, 35], [12, 0, 5, 6, 1])
                assert h.done and h.status == "ok"
                assert_device_holds(loader, dict(zip([12, 0, 5, 6, 1], data)))
                eng.host_pool.tensor.view(torch.int16).fill_(POISON)
                loader.store([1, 12], [7, 8]).wait()
                assert torch.equal(eng.host_pool.page_view(7), data[4])
                assert torch.equal(eng.host_pool.page_view(8), data[0])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_copy_path_with_tiny_staging(engines, layout, method):
    """Small and large batches (one-shot vs per-layer gathers), staging of 2 pages (many chunks)."""
    rng = np.random.default_rng(5)
    eng = engines(layout)
    with DeviceLoader(eng.host_pool, device="cpu", num_device_pages=64, method=method,
                      staging_pages=2) as loader:
        data = random_pages(eng.geometry, 40, seed=6)
        slots = rng.permutation(64)[:40]
        for slot, page in zip(slots, data):
            eng.host_pool.page_view(int(slot)).copy_(page)
        poison(loader)
        dev = rng.permutation(64)[:40]
        expected = {}
        for lo, hi in [(0, 3), (3, 23), (23, 40)]:  # 3 pages, then 20 (>= PER_LAYER_MIN_PAGES)
            h = loader.load_pages(slots[lo:hi], dev[lo:hi])
            assert h.wait(5) and h.pages_loaded == hi - lo
            expected.update({int(dev[i]): data[i] for i in range(lo, hi)})
            assert_device_holds(loader, expected)
        eng.host_pool.tensor.view(torch.int16).fill_(POISON)
        back = rng.permutation(64)[:40]
        loader.store(dev, back).wait()
        for slot, page in zip(back, data):
            assert torch.equal(eng.host_pool.page_view(int(slot)).view(torch.int16), page.view(torch.int16))


def test_bad_input_raises(engines):
    eng = engines("page_first")
    with DeviceLoader(eng.host_pool, device="cpu", num_device_pages=4) as loader:
        with pytest.raises(ValueError, match="out of range"):
            loader.load_pages([0], [4])
        with pytest.raises(ValueError, match="repeat"):
            loader.load_pages([0, 1], [2, 2])
        with pytest.raises(ValueError, match="host pages"):
            loader.load_pages([0, 1], [2])
        with pytest.raises(ValueError, match="engine"):
            loader.store([0], [0], keys=["k"])
        with pytest.raises(ValueError, match="method"):
            DeviceLoader(eng.host_pool, device="cpu", num_device_pages=4, method="magic")
        loader.close()
        with pytest.raises(RuntimeError, match="closed"):
            loader.load_pages([0], [0])


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: run scripts/device/gpu_check_device.py on a GPU machine")
def test_gpu_check_script():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "device", "gpu_check_device.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


class _SteppedOp:
    """An op whose progress the test sets by hand (the engine drives real ones above)."""

    def __init__(self, host_pages):
        self.host_pages = np.asarray(host_pages, dtype=np.int64)
        self.num_pages = len(host_pages)
        self.completed_pages = 0
        self.done = False
        self.status = "running"
        self.device_event = None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loader_drives_the_engine_from_its_poll_and_closes_with_it(store, layout):
    n = 12
    keys = [f"owned-{i}" for i in range(n)]
    eng = make_engine(store, layout)
    try:
        data = random_pages(eng.geometry, n, seed=5)
        backup(eng, keys, range(n), data)
        loader = DeviceLoader(eng.host_pool, device="cpu", num_device_pages=16, engine=eng)
        poison(loader)
        op = eng.prefetch(keys, range(20, 20 + n))
        handle = loader.load(op, list(range(15, 15 - n, -1)))
        assert op.device_event is handle
        for _ in range(20000):  # only loader.poll(): it polls the engine, then steps
            loader.poll()
            if handle.done:
                break
        assert handle.done and handle.pages_loaded == n
        assert_device_holds(loader, {15 - i: data[i] for i in range(n)})
    finally:
        eng.close()
    with pytest.raises(Exception):
        loader.load_pages([0], [0])  # closed together with the engine


def test_poll_with_nothing_landed_does_not_look_at_the_loads(store):
    """A scheduler polls far more often than pages land: a step after which no page
    outcome came in costs one compare in the loader, however many loads are in
    flight; the loads then finish with the bytes."""
    import signal
    import time
    n, loads = 4, 64
    with make_engine(store, "page_first", pages=n * loads) as eng:
        keys = [f"many-{i}" for i in range(n * loads)]
        data = random_pages(eng.geometry, n * loads, seed=9)
        backup(eng, keys, range(n * loads), data)
        loader = DeviceLoader(eng.host_pool, device="cpu", num_device_pages=n * loads, engine=eng)
        poison(loader)
        pids = eng.worker_pids()
        for pid in pids:  # paused: nothing can land while the cost is measured
            os.kill(pid, signal.SIGSTOP)
        try:
            handles = [loader.load(eng.prefetch(keys[j * n:(j + 1) * n], range(j * n, (j + 1) * n)),
                                   list(range(j * n, (j + 1) * n))) for j in range(loads)]
            eng.poll()

            def median_ns(fn):
                times = []
                for _ in range(2001):
                    t = time.perf_counter_ns()
                    fn()
                    times.append(time.perf_counter_ns() - t)
                return sorted(times)[len(times) // 2]

            looking = median_ns(loader._advance_all)  # what a step that looks costs here
            step = median_ns(loader.step)
            assert not any(h.issued for h in handles)
            # 64 loads: ~40 µs to look at them all on the 2-core box; a step with
            # nothing new is one compare under the engine's lock.
            assert step * 10 < looking, (step, looking)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        for h in handles:
            assert h.wait(30) and h.status == "ok" and h.pages_loaded == n
        assert_device_holds(loader, {i: data[i] for i in range(n * loads)})
