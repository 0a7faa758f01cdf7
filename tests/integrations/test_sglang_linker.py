"""SGLang's direct L3 path served by hicache_mp (decision 101), on CPU, with
SGLang 0.5.23's real classes: `create_unified_cache_linker` (its `dynamic`
backend) builds the linker, `MHATokenToKVPool` / `MLATokenToKVPool` with a
real `PagedTokenToKVPoolAllocator` are the device pools (CPU tensors),
`PoolTransfer` carries the calls and `LayerWiseLoadCounter` is the counter
the forward waits on. The call order is SGLang's wrapper's (offload, lookup,
load, start_layer_wise_loading, set_consumer + wait_until per layer,
finish_layer_wise_loading); test_sglang_linker_tree.py drives the same
linker through the real `UnifiedRadixCache` and `UnifiedCacheLinkerWrapper`.

What a user would notice is asserted: the bytes in the request's device
slots, what lookup answers, whether the batch says it landed, and that
nothing (process, segment, thread) is left behind.

Reaches inside: `real._ensure_torchvision` (hicache_mp.bench.sglang.real), the
bench's one placeholder for torchvision's import-time-only uses, which
SGLang's model configs import and CI cannot install for a CPU torch.
"""
import os
import signal
import threading
import time

import pytest
import torch

from hicache_mp.bench.sglang import real

real._ensure_torchvision()  # noqa: E402  (sglang.srt.configs imports torchvision; CI has none)

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import \
    create_unified_cache_linker  # noqa: E402
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import \
    LayerWiseLoadCounter  # noqa: E402

from hicache_mp.integrations.sglang.linker import HiCacheMPLinker  # noqa: E402

PS, LAYERS, TOKENS = 4, 4, 512


class Args:
    """What the linker reads of ServerArgs."""

    def __init__(self, model_path="/models/linker-test"):
        self.model_path = model_path


def device_pool(mla=False):
    if mla:
        pool = MLATokenToKVPool(size=TOKENS, page_size=PS, dtype=torch.bfloat16, kv_lora_rank=12,
                                qk_rope_head_dim=4, layer_num=LAYERS, device="cpu",
                                enable_memory_saver=False)
    else:
        pool = MHATokenToKVPool(size=TOKENS, page_size=PS, dtype=torch.bfloat16, head_num=2,
                                head_dim=8, layer_num=LAYERS, device="cpu",
                                enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(size=TOKENS, page_size=PS, dtype=torch.bfloat16,
                                        device="cpu", kvcache=pool, need_sort=False)
    gen = torch.Generator().manual_seed(3)
    for t in planes(pool):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return pool, alloc


def planes(pool):
    return list(pool.kv_buffer) if hasattr(pool, "kv_buffer") else \
        list(pool.k_buffer) + list(pool.v_buffer)


def linker(store, alloc, model="/models/linker-test", **extra):
    params = CacheInitParams(disable=False, req_to_token_pool=None,
                             token_to_kv_pool_allocator=alloc, page_size=PS)
    cfg = {"linker": "HiCacheMPLinker",
           "linker_module_path": "hicache_mp.integrations.sglang.linker",
           "linker_extra_config": {"storage_dir": str(store), "num_workers": 1,
                                   "load_pages": 32, **extra}}
    return create_unified_cache_linker(Args(model), params, backend="dynamic", config=cfg,
                                       components={ComponentType.FULL})


def kv(keys, slots=None):
    return [PoolTransfer(name=PoolName.KV, keys=list(keys),
                         device_indices=None if slots is None else slots.to(torch.int64))]


def offload(link, keys, slots):
    assert link.offload(kv(keys, slots))
    deadline = time.monotonic() + 20
    while link.num_completed_offloads() == 0:
        assert time.monotonic() < deadline, "offload never completed"
        time.sleep(0.005)
    return link.pop_completed_offload()


def load(link, rid, keys, slots):
    """SGLang's order for one batch: whether it landed."""
    assert link.load(rid, kv(keys, slots))
    return forward_and_finish(link, link.start_layer_wise_loading())


def forward_and_finish(link, index):
    """The forward's waits on batch `index`, layer by layer, then its finish: landed or not."""
    counter = link.layer_done_counter
    counter.set_consumer(index)
    for layer in range(LAYERS):
        counter.wait_until(layer)
    return link.finish_layer_wise_loading(index)


def same_rows(pool, a, b):
    return all(torch.equal(t[a], t[b]) for t in planes(pool))


@pytest.mark.parametrize("mla,groups", [(False, 2), (False, 4), (True, 2)])
def test_stored_then_loaded_into_other_slots_byte_for_byte(tmp_path, mla, groups):
    pool, alloc = device_pool(mla)
    link = linker(tmp_path, alloc, layer_groups=groups)
    try:
        assert isinstance(link, HiCacheMPLinker)
        assert isinstance(link.layer_done_counter, LayerWiseLoadCounter)
        assert link.pools == {PoolName.KV: pool}
        src = alloc.alloc(5 * PS)
        keys = [f"h{i}" for i in range(5)]
        assert offload(link, keys, src) is True
        # the whole prefix, every shorter prefix, nothing past a missing page
        assert link.lookup("r", kv(keys + ["absent", "h9"])) == [1, 2, 3, 4, 5]
        dst = alloc.alloc(5 * PS)
        assert not same_rows(pool, src, dst)
        assert load(link, "r", keys, dst) is True
        assert same_rows(pool, src, dst)
    finally:
        link.close()


def test_a_page_from_the_hicache_backend_is_found_and_loaded(tmp_path):
    """The store is one store: pages written whole under the HiCache backend's
    namespace (SGLangShard.engine_names) are the linker's."""
    from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
    from hicache_mp.integrations.sglang.backend import server_identity
    from hicache_mp.integrations.sglang.names import SGLangShard

    class StorageConfig:  # what the HiCache controller hands its backend
        model_name, tp_rank, tp_size, is_mla_model, extra_config = \
            "/models/linker-test", 0, 1, False, {}
    shard = SGLangShard.from_storage_config(StorageConfig, server_identity(StorageConfig, {}))
    g = PageGeometry(num_layers=LAYERS, num_kv_heads=2, head_dim=8, page_size=PS,
                     dtype="bfloat16")
    pool, alloc = device_pool()
    src = alloc.alloc(2 * PS)
    with PrefetchEngine(EngineConfig(storage_dir=str(tmp_path), host_pool_pages=2,
                                     num_workers=1, **shard.engine_names()), g) as hicache:
        page = hicache.host_pool.tensor  # [page, kv, layer, token, head, dim]
        for i in range(2):
            for layer in range(LAYERS):
                page[i, 0, layer] = pool.k_buffer[layer][src[i * PS:(i + 1) * PS]]
                page[i, 1, layer] = pool.v_buffer[layer][src[i * PS:(i + 1) * PS]]
        op = hicache.backup(["a", "b"], [0, 1])
        hicache.wait(op)
        assert op.status == "ok"
    link = linker(tmp_path, alloc, layer_groups=2)
    try:
        assert link.lookup("r", kv(["a", "b"])) == [1, 2]
        dst = alloc.alloc(2 * PS)
        assert load(link, "r", ["a", "b"], dst) is True
        assert same_rows(pool, src, dst)
    finally:
        link.close()


def test_another_model_at_the_same_path_misses(tmp_path):
    pool, alloc = device_pool()
    first = linker(tmp_path, alloc, namespace="base-model")
    try:
        assert offload(first, ["x", "y"], alloc.alloc(2 * PS)) is True
        assert first.lookup("r", kv(["x", "y"])) == [1, 2]
    finally:
        first.close()
    other = linker(tmp_path, alloc, namespace="fine-tune")
    try:
        assert other.lookup("r", kv(["x", "y"])) == []
    finally:
        other.close()


def test_a_page_gone_after_lookup_fails_the_batch_never_the_process(tmp_path):
    pool, alloc = device_pool()
    link = linker(tmp_path, alloc, layer_groups=2)
    try:
        src = alloc.alloc(3 * PS)
        keys = ["p0", "p1", "p2"]
        assert offload(link, keys, src) is True
        assert link.lookup("r", kv(keys)) == [1, 2, 3]
        for d, _, files in os.walk(tmp_path):
            for f in files:
                if f.endswith(".page"):
                    os.unlink(os.path.join(d, f))
                    break
            else:
                continue
            break
        dst = alloc.alloc(3 * PS)
        assert load(link, "r", keys, dst) is False  # SGLang aborts the request
        # the next batch is served (the engine and its workers are fine)
        src2 = alloc.alloc(PS)
        assert offload(link, ["q0"], src2) is True
        dst2 = alloc.alloc(PS)
        assert load(link, "r2", ["q0"], dst2) is True
        assert same_rows(pool, src2, dst2)
    finally:
        link.close()


def test_a_worker_killed_mid_load_fails_that_batch_cleanly(tmp_path):
    pool, alloc = device_pool()
    link = linker(tmp_path, alloc, layer_groups=2, load_timeout_s=20)
    try:
        src = alloc.alloc(8 * PS)
        keys = [f"k{i}" for i in range(8)]
        assert offload(link, keys, src) is True
        # a worker stopped before it reads, then killed: its pages end worker_died
        pid = link.worker_pids()["reader"][0]
        os.kill(pid, signal.SIGSTOP)
        try:
            dst = alloc.alloc(8 * PS)
            assert link.load("r", kv(keys, dst))
            index = link.start_layer_wise_loading()
            time.sleep(0.2)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        assert forward_and_finish(link, index) is False
        dst2 = alloc.alloc(8 * PS)  # a replacement worker serves the next batch
        assert load(link, "r2", keys, dst2) is True
        assert same_rows(pool, src, dst2)
    finally:
        link.close()


def test_queued_loads_cancel_and_a_full_pool_refuses_instead_of_queueing(tmp_path):
    pool, alloc = device_pool()
    link = linker(tmp_path, alloc, layer_groups=2, load_pages=4)
    try:
        keys = [f"c{i}" for i in range(3)]
        assert offload(link, keys, alloc.alloc(3 * PS)) is True
        assert link.load("a", kv(keys, alloc.alloc(3 * PS)))
        assert not link.load("b", kv(keys, alloc.alloc(3 * PS)))  # 6 + 6 slots > 8
        assert link.cancel_queued_load("a") and not link.cancel_queued_load("a")
        assert link.start_layer_wise_loading() == -1  # nothing queued
        assert link.load("b", kv(keys, alloc.alloc(3 * PS)))  # the slots came back
        assert link.cancel_queued_load("b")
    finally:
        link.close()


def test_no_thread_of_ours_and_nothing_left_after_close(tmp_path):
    before = {t.ident for t in threading.enumerate()}
    pool, alloc = device_pool()
    link = linker(tmp_path, alloc)
    assert {t.ident for t in threading.enumerate()} - before == set(), \
        "the linker must leave the scheduler's process to SGLang's own threads"
    src = alloc.alloc(2 * PS)
    assert offload(link, ["t0", "t1"], src) is True
    assert load(link, "r", ["t0", "t1"], alloc.alloc(2 * PS)) is True
    pids = link.worker_pids()["reader"] + link.worker_pids()["writer"]
    link.close()
    link.close()  # twice is harmless
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(p) for p in pids)


def test_the_linkers_engines_share_one_cpu_budget_without_a_warning(tmp_path, monkeypatch,
                                                                   caplog):
    """A node of 4 cores (this test's own registry), auto workers and one
    offload worker: the writer is an auxiliary of the scheduler's process (no
    core of its own kept for a scheduler), made first, so the reader takes
    what it leaves: 4 - 1 (the scheduler) - 1 = 2 workers, and no budget
    warning (made after a reader that took 3, the writer was over the budget)."""
    import logging
    monkeypatch.setenv("HICACHE_MP_NODE_CORES", "4")
    monkeypatch.setenv("HICACHE_MP_NODE_DIR", str(tmp_path / "node"))
    caplog.set_level(logging.INFO)
    pool, alloc = device_pool()
    link = linker(tmp_path / "store", alloc, num_workers=0, offload_workers=1)
    try:
        pids = link.worker_pids()
        assert (len(pids["reader"]), len(pids["writer"])) == (2, 1), pids
        budget = [r.getMessage() for r in caplog.records
                  if r.levelno >= logging.WARNING and "CPU budget" in r.getMessage()]
        assert budget == []
        src = alloc.alloc(2 * PS)
        assert offload(link, ["w0", "w1"], src) is True
        dst = alloc.alloc(2 * PS)
        assert load(link, "r", ["w0", "w1"], dst) is True
        assert same_rows(pool, src, dst)
    finally:
        link.close()


def test_bad_config_is_one_clear_error_before_any_worker(tmp_path):
    pool, alloc = device_pool()
    with pytest.raises(ValueError, match="unknown linker_extra_config key"):
        linker(tmp_path, alloc, layer_group=2)
    with pytest.raises(ValueError, match="divisor of 4"):
        linker(tmp_path, alloc, layer_groups=3)
    with pytest.raises(ValueError, match="must be positive"):
        linker(tmp_path, alloc, load_pages=0)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
