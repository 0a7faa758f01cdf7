"""The SGLang adapter inside a real server: a stuck worker, signals, metrics off.

Same real SGLang classes and stand-in host pool as test_sglang.
"""
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from test_sglang import attach, fill_random  # noqa: F401 (attach is a fixture)


@pytest.mark.parametrize("allocator", ["shm", "default"])  # zero-copy and staged
def test_io_timeout_bounds_a_batch_with_a_stuck_worker(attach, allocator):  # noqa: F811
    backend, pool = attach(layout="layer_first", allocator=allocator, io_timeout_s=0.5,
                           pages=16)
    keys = [f"t{i}" for i in range(8)]
    want = fill_random(pool, range(8), seed=5)
    assert backend.batch_set_v1(keys, pool.token_indices(range(8))) == [True] * 8
    stuck = backend.engine.worker_pids()[1]
    os.kill(stuck, signal.SIGSTOP)  # a hung read, frozen where it stands
    release = threading.Timer(20.0, lambda: os.kill(stuck, signal.SIGCONT))
    release.start()
    try:
        pool.kv_buffer.zero_()
        t0 = time.monotonic()
        got = backend.batch_get_v1(keys, pool.token_indices(range(8, 16)))
        took = time.monotonic() - t0
    finally:
        release.cancel()
        try:
            os.kill(stuck, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert took < 6.0, took  # io_timeout_s + the grace to skip, not the stuck worker's time
    lead = got.index(False) if False in got else len(got)
    assert 0 < lead < 8 and got == [True] * lead + [False] * (8 - lead), got
    for i in range(lead):
        assert torch.equal(pool.get_data_page((8 + i) * pool.page_size), want[i])
    # Nothing may write those slots any more: SGLang reuses them at once.
    assert not psutil.pid_exists(stuck) or psutil.Process(stuck).status() == psutil.STATUS_ZOMBIE
    pool.kv_buffer[..., :] = 7
    time.sleep(0.3)
    assert bool((pool.kv_buffer == 7).all())
    # and the backend goes on: the stuck worker was replaced
    assert backend.batch_get_v1(keys, pool.token_indices(range(8, 16))) == [True] * 8
    assert all(torch.equal(pool.get_data_page((8 + i) * pool.page_size), want[i])
               for i in range(8))


def _sglang_storage_metrics_class():
    """SGLang's own StorageMetrics, compiled from its source: the module that holds
    it needs transformers, which the test environment does not install."""
    import ast
    import dataclasses
    import importlib.util
    import typing
    spec = importlib.util.find_spec("sglang.srt.observability")
    path = os.path.join(list(spec.submodule_search_locations)[0], "metrics_collector.py")
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StorageMetrics")
    ns = {"dataclass": dataclasses.dataclass, "field": dataclasses.field, "List": typing.List}
    exec(compile(ast.Module([node], []), path, "exec"), ns)
    return ns["StorageMetrics"]


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("module", ["sglang.srt.observability.metrics_collector",
                                    "sglang.srt.metrics.collector"])
def test_per_call_stats_only_when_sglang_asks_for_them(store, monkeypatch, enabled, module):
    import sys
    import types

    import sglang.srt.mem_cache.hicache_storage as sgl_storage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang_pool import CpuMHAHostPool
    from test_sglang import DYNAMIC

    # Only `module` has StorageMetrics: the other import path fails, as on that SGLang.
    for name in ("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector"):
        holder = types.ModuleType(name)
        if name == module:
            holder.StorageMetrics = _sglang_storage_metrics_class()
        monkeypatch.setitem(sys.modules, name, holder if name == module else None)
    cfg = sgl_storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=enabled, is_page_first_layout=False,
        model_name="m", extra_config={**DYNAMIC, "storage_dir": store})
    pool = CpuMHAHostPool(layout="layer_first", allocator_type="shm", pages=8)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    try:
        backend.register_mem_pool_host(pool)
        fill_random(pool, [0, 1], seed=9)
        for i in range(20):
            assert backend.batch_set_v1([f"m{i}a", f"m{i}b"], pool.token_indices([0, 1])) == \
                [True, True]
            assert backend.batch_get_v1([f"m{i}a", f"m{i}b"], pool.token_indices([2, 3])) == \
                [True, True]
        assert backend.metrics()["get_calls"] == 20 and backend.metrics()["set_calls"] == 20
        stats = backend.get_stats()
        assert type(stats).__name__ == "StorageMetrics"
        want = 20 if enabled else 0  # off: nothing kept, so nothing grows
        assert (len(stats.prefetch_pgs), len(stats.backup_pgs), len(stats.prefetch_bandwidth),
                len(stats.backup_bandwidth)) == (want,) * 4
        assert stats.prefetch_pgs == [2] * want
        assert backend.get_stats().prefetch_pgs == []  # emptied by the poll
    finally:
        backend.close()
        pool.close()


def test_batch_calls_survive_signals(attach):  # noqa: F811
    """SGLang's storage threads sit in batch_get_v1 while the server's signal
    handlers fire: no SignalError may escape."""
    hits = []
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    try:
        backend, pool = attach(layout="layer_first", pages=16)
        keys = [f"g{i}" for i in range(8)]
        want = fill_random(pool, range(8), seed=6)
        assert backend.batch_set_v1(keys, pool.token_indices(range(8))) == [True] * 8
        stuck = backend.engine.worker_pids()[0]
        os.kill(stuck, signal.SIGSTOP)  # the batch must wait while the signals fly
        got, errors = [], []

        def get():
            try:
                got.append(backend.batch_get_v1(keys, pool.token_indices(range(8, 16))))
            except BaseException as exc:
                errors.append(repr(exc))

        t = threading.Thread(target=get)
        t.start()
        try:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                signal.pthread_kill(t.ident, signal.SIGUSR1)
                time.sleep(0.002)
        finally:
            os.kill(stuck, signal.SIGCONT)
        t.join(30)
        assert not errors, errors
        assert got == [[True] * 8] and len(hits) > 50
        assert all(torch.equal(pool.get_data_page((8 + i) * pool.page_size), want[i])
                   for i in range(8))
    finally:
        signal.signal(signal.SIGUSR1, old)
