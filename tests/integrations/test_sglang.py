"""HiCacheMP through the real SGLang package (pinned: .ci/sglang-requirements.txt).

SGLang's own HiCacheStorage, HiCacheStorageConfig, StorageBackendFactory,
HiCacheFile and memfd allocator (alloc_shm) are used for real. The host pool
is `sglang_pool.CpuMHAHostPool` (its docstring says exactly why SGLang's class
cannot be built here), on memory from SGLang's own allocators.
"""
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

try:
    import sglang.srt.mem_cache.hicache_storage as sgl_storage
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as exc:  # noqa: F841
    pytest.skip(f"SGLang is not importable ({exc}); install it with "
                f"`pip install --no-deps -r .ci/sglang-requirements.txt`", allow_module_level=True)

from sglang_pool import CpuMHAHostPool  # noqa: E402

from hicache_mp.integrations.sglang import HiCacheMP  # noqa: E402
from hicache_mp.integrations.sglang.names import SGLangShard  # noqa: E402
from shm.names import list_ours  # noqa: E402

DYNAMIC = {"backend_name": "hicache_mp", "module_path": "hicache_mp.integrations.sglang",
           "class_name": "HiCacheMP", "interface_v1": 1, "allocator": "shm", "num_workers": 2}


def storage_config(store, *, tp_rank=0, tp_size=1, mla=False, pp_rank=0, pp_size=1,
                   model="meta-llama/Llama-3.1-8B", layout="layer_first", **extra):
    return sgl_storage.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=layout == "page_first", model_name=model,
        extra_config={**DYNAMIC, "storage_dir": store, **extra})


@pytest.fixture
def attach(store):
    """attach(layout, allocator, **cfg) -> (backend, pool), built like SGLang's
    cache_controller does: factory.create_backend, then register_mem_pool_host."""
    made = []

    def make(layout="layer_first", allocator="shm", pages=12, **cfg):
        pool = CpuMHAHostPool(layout=layout, allocator_type=allocator, pages=pages)
        backend = StorageBackendFactory.create_backend(
            "dynamic", storage_config(cfg.pop("store", store), layout=layout, **cfg), pool)
        made.append((backend, pool))
        backend.register_mem_pool_host(pool)
        return backend, pool

    yield make
    for backend, pool in made:
        backend.close()
        pool.close()


def fill_random(pool, pages, seed):
    """Random page contents, written through SGLang's own set_from_flat_data_page."""
    gen = torch.Generator().manual_seed(seed)
    flats = []
    for p in pages:
        flat = torch.randn(pool.get_dummy_flat_data_page().numel(), generator=gen).to(pool.dtype)
        pool.set_from_flat_data_page(p * pool.page_size, flat)
        flats.append(flat)
    return flats


def logical(pool, page):
    """Page contents in [kv, layer, token, head, dim] order, whatever the layout."""
    P, L, H, D = pool.page_size, pool.layer_num, pool.head_num, pool.head_dim
    flat = pool.get_data_page(page * P, flat=True)
    if pool.layout in ("layer_first", "page_first_direct"):
        return flat.view(2, L, P, H, D)
    if pool.layout == "page_first":
        return flat.view(2, P, L, H, D).transpose(1, 2)
    return flat.view(2, H, P, L, D).permute(0, 3, 2, 1, 4)


def test_factory_builds_hicache_mp_from_the_dynamic_config(attach):
    backend, pool = attach()
    assert type(backend) is HiCacheMP
    assert isinstance(backend, sgl_storage.HiCacheStorage)
    assert backend.mem_pool_host is pool
    assert backend.zero_copy


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_zero_copy_round_trip_into_sglangs_memfd_pool(attach, layout):
    backend, pool = attach(layout)
    src, dst = [1, 4, 6, 9, 11], [0, 2, 3, 7, 10]
    want = fill_random(pool, src, seed=1)
    keys = [f"{layout}-page-{i}" for i in range(len(src))]

    assert backend.batch_set_v1(keys, pool.token_indices(src)) == [True] * len(src)
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, pool.token_indices(dst)) == [True] * len(dst)
    for page, flat in zip(dst, want):
        assert torch.equal(pool.get_data_page(page * pool.page_size), flat)

    m = backend.metrics()
    # The proof: workers mapped SGLang's memfd (no pool segment of our own),
    # read and wrote its slots, and no staging copy ran.
    assert m["zero_copy"] and m["shared_pool"]
    assert m["staging_copies"] == 0
    assert m["read_pages_ok"] == len(dst) and m["write_pages_ok"] == len(src)
    assert not [e for e in list_ours() if e.startswith(backend.engine.tag) and e.endswith(".pool")]
    assert backend.engine.host_pool.segment.owner is False


def test_zero_copy_workers_write_straight_into_sglang_memory(attach):
    """Bytes a worker reads land in the tensor SGLang allocated, at the pointers
    get_page_buffer_meta names: check through a raw pointer read of that memory."""
    import ctypes

    backend, pool = attach("layer_first")
    want = fill_random(pool, [3], seed=2)[0]
    assert backend.batch_set_v1(["k"], pool.token_indices([3])) == [True]
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(["k"], pool.token_indices([5])) == [True]
    ptrs, sizes = pool.get_page_buffer_meta(pool.token_indices([5]))
    got = b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))  # layer-major K,V pairs
    L = pool.layer_num
    k, v = want.view(2, L, -1)
    expect = b"".join(k[layer].view(torch.uint8).numpy().tobytes() +
                      v[layer].view(torch.uint8).numpy().tobytes() for layer in range(L))
    assert got == expect
    assert backend.metrics()["staging_copies"] == 0


@pytest.mark.parametrize("layout,allocator,why", [
    ("page_first", "shm", "host layout 'page_first'"),
    ("layer_first", "default", "no file descriptor"),
])
def test_fallback_stages_copies_and_warns_once(attach, caplog, layout, allocator, why):
    caplog.set_level(logging.WARNING, logger="hicache_mp.sglang")
    backend, pool = attach(layout, allocator)
    src, dst = [2, 5, 8], [1, 9, 10]
    want = fill_random(pool, src, seed=3)
    keys = [f"{layout}-{allocator}-{i}" for i in range(3)]
    assert backend.batch_set_v1(keys, pool.token_indices(src)) == [True] * 3
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, pool.token_indices(dst)) == [True] * 3
    for page, flat in zip(dst, want):
        assert torch.equal(pool.get_data_page(page * pool.page_size), flat)
    m = backend.metrics()
    assert not m["zero_copy"] and why in m["fallback_reason"]
    assert m["staging_copies"] == 6  # 3 pages out, 3 pages in
    warnings = [r for r in caplog.records if "not zero-copy" in r.getMessage()]
    assert len(warnings) == 1
    assert '"allocator":"shm"' in warnings[0].getMessage()
    assert "layer_first or page_first_direct" in warnings[0].getMessage()


def test_zero_copy_off_by_setting_warns_without_telling_how_to_turn_it_on(attach, caplog):
    """"zero_copy": false is the user's choice: the warning names it and does not
    tell them how to get zero-copy (the allocator/layout hint is for pools that
    cannot have it)."""
    caplog.set_level(logging.WARNING, logger="hicache_mp.sglang")
    backend, _ = attach(zero_copy=False)
    assert not backend.zero_copy
    warnings = [r.getMessage() for r in caplog.records if "not zero-copy" in r.getMessage()]
    assert len(warnings) == 1 and '"zero_copy": false' in warnings[0], warnings
    assert "For zero-copy" not in warnings[0] and '"allocator":"shm"' not in warnings[0]


@pytest.mark.parametrize("allocator", ["shm", "default"])  # zero-copy and staged
def test_a_key_too_long_for_a_file_name_is_a_miss_never_an_exception(attach, caplog, allocator):
    """A key the store refuses (longer than 4096 bytes) ends as the adapter's
    normal failure: not stored, a miss for get and exists; no exception
    reaches SGLang's scheduler, no byte of the pool changes, one warning."""
    caplog.set_level(logging.WARNING, logger="hicache_mp.sglang")
    backend, pool = attach(allocator=allocator)
    long_key = "L" * 5000
    fill_random(pool, [0, 1], seed=8)
    assert backend.batch_set_v1([long_key], pool.token_indices([0])) == [False]
    assert backend.batch_set_v1(["ok0", long_key], pool.token_indices([0, 1])) == [False, False]
    pool.kv_buffer[..., :] = 3
    assert backend.batch_get_v1([long_key], pool.token_indices([4])) == [False]
    assert backend.batch_get_v1(["ok0", long_key], pool.token_indices([4, 5])) == [False, False]
    assert bool((pool.kv_buffer == 3).all())
    assert backend.batch_exists([long_key]) == 0 and backend.exists(long_key) is False
    assert backend.batch_exists(["ok0", long_key]) == 0
    assert backend.hit_query_at_once([long_key]) is False
    assert backend.batch_get([long_key]) == [None] and backend.batch_set([long_key], [
        pool.get_data_page(0, flat=True)]) is False
    said = [r.getMessage() for r in caplog.records if "refuses" in r.getMessage()]
    assert len(said) == 1 and "longer than 4096" in said[0], said
    want = fill_random(pool, [2], seed=9)    # the backend goes on
    assert backend.batch_set_v1(["ok1"], pool.token_indices([2])) == [True]
    assert backend.batch_get_v1(["ok1"], pool.token_indices([6])) == [True]
    assert torch.equal(pool.get_data_page(6 * pool.page_size), want[0])


def test_layouts_share_one_store(attach, store):
    """Files are canonical: pages backed up from a page_first (staged) pool read
    zero-copy into page_first_direct and layer_first pools, and back."""
    writer, wpool = attach("page_first")
    want = fill_random(wpool, [1, 2, 3], seed=4)
    keys = ["x0", "x1", "x2"]
    assert all(writer.batch_set_v1(keys, wpool.token_indices([1, 2, 3])))
    ref = [logical(wpool, p).clone() for p in (1, 2, 3)]
    for layout in ("page_first_direct", "layer_first"):
        reader, rpool = attach(layout)
        assert reader.zero_copy
        assert reader.batch_get_v1(keys, rpool.token_indices([7, 0, 4])) == [True] * 3
        for page, r in zip((7, 0, 4), ref):
            assert torch.equal(logical(rpool, page), r)
    assert len(want) == 3


def test_batch_exists_counts_leading_pages_with_a_hole(attach):
    backend, pool = attach()
    fill_random(pool, range(5), seed=5)
    keys = [f"e{i}" for i in range(5)]
    present = [0, 1, 3, 4]
    assert all(backend.batch_set_v1([keys[i] for i in present], pool.token_indices(present)))
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(keys[3:]) == 2
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.exists("e3") and not backend.exists("e2")
    # batch_get_v1: the first miss ends the leading run, later hits are reported False
    assert backend.batch_get_v1(keys, pool.token_indices(range(5))) == [True, True, False, False, False]


def test_exists_sees_pages_another_process_wrote(attach, store, monkeypatch):
    """An MLA reader rank finds the writer rank's new pages in batch_exists:
    its workers stat the keys its index misses. Its own (the scheduler's)
    process walks nothing and stats nothing, and runs no rescan thread."""
    a, pool_a = attach(tp_rank=0, tp_size=2, mla=True)
    b, _ = attach(tp_rank=1, tp_size=2, mla=True)
    keys = [f"late{i}" for i in range(6)]
    fill_random(pool_a, range(6), seed=6)
    assert b.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, pool_a.token_indices(range(6))) == [True] * 6
    calls = []
    for name in ("scandir", "listdir", "walk", "stat", "lstat"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    time.sleep(0.3)  # past the probe's negative cache for these keys (hicache_mp.engine.discovery)
    assert b.batch_exists(keys) == 6   # one call: it waits for the workers' answers
    monkeypatch.undo()
    assert calls == []
    assert b.metrics()["probes_found"] == 6
    assert b.engine.config.rescan_interval_s == 0


def test_namespace_follows_sglang_suffix_rules(store, tmp_path):
    """Our shard names are SGLang's: compare with HiCacheFile's real suffix."""
    cases = [dict(tp_rank=1, tp_size=2), dict(tp_rank=1, tp_size=4, mla=True),
             dict(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2), dict(model="a/b/c")]
    for kw in cases:
        cfg = storage_config(store, file_storage_path=str(tmp_path / "sgl"), **kw)
        ref = sgl_storage.HiCacheFile(cfg)
        assert SGLangShard.from_storage_config(cfg).file_suffix == ref.config_suffix


def test_tp_ranks_never_collide_and_mla_ranks_share(attach):
    rank0, pool0 = attach(tp_rank=0, tp_size=2)
    rank1, pool1 = attach(tp_rank=1, tp_size=2)
    fill_random(pool0, [0], seed=7)
    assert rank0.batch_set_v1(["shared-key"], pool0.token_indices([0])) == [True]
    assert rank1.batch_exists(["shared-key"]) == 0
    assert rank1.batch_get_v1(["shared-key"], pool1.token_indices([0])) == [False]

    # MLA KV is replicated over TP: every rank uses one namespace, so rank 1 reads
    # what rank 0 (SGLang's only MLA writer) stored.
    mla0, mpool0 = attach(tp_rank=0, tp_size=2, mla=True)
    mla1, mpool1 = attach(tp_rank=1, tp_size=2, mla=True)
    assert mla0.engine.namespace == mla1.engine.namespace
    assert len({mla0.engine.namespace, rank0.engine.namespace, rank1.engine.namespace}) == 3
    want = fill_random(mpool0, [1], seed=11)[0]
    assert mla0.batch_set_v1(["mla-key"], mpool0.token_indices([1])) == [True]
    assert mla1.batch_exists(["mla-key"]) == 1
    assert mla1.batch_get_v1(["mla-key"], mpool1.token_indices([2])) == [True]
    assert torch.equal(mpool1.get_data_page(2 * mpool1.page_size), want)


def test_legacy_api_round_trip(attach):
    backend, pool = attach("page_first", "shm", interface_v1=0)
    pages = fill_random(pool, [0, 1], seed=8)
    data = [pool.get_data_page(p * pool.page_size, flat=True) for p in (0, 1)]
    assert backend.batch_set(["l0", "l1"], data) is True
    targets = [pool.get_dummy_flat_data_page() for _ in range(3)]
    got = backend.batch_get(["l0", "l1", "missing"], targets)
    assert torch.equal(got[0], pages[0]) and torch.equal(got[1], pages[1]) and got[2] is None
    assert torch.equal(backend.get("l1"), pages[1])
    assert backend.set("l2", data[0]) and backend.exists("l2")


def test_legacy_api_in_zero_copy_mode_uses_a_staging_engine(attach):
    backend, pool = attach("layer_first")
    assert backend.zero_copy
    flat = fill_random(pool, [2], seed=9)[0]
    assert backend.set("z", pool.get_data_page(2 * pool.page_size))
    assert backend.exists("z")
    assert torch.equal(backend.get("z"), flat)
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(["z"], pool.token_indices([6])) == [True]  # same store, zero-copy
    assert torch.equal(pool.get_data_page(6 * pool.page_size), flat)


def test_stats_clear_close(attach, store, caplog):
    caplog.set_level(logging.WARNING, logger="hicache_mp.sglang")
    backend, pool = attach()
    fill_random(pool, [0, 1], seed=10)
    assert all(backend.batch_set_v1(["s0", "s1"], pool.token_indices([0, 1])))
    assert backend.batch_get_v1(["s0", "s1"], pool.token_indices([2, 3])) == [True, True]
    stats = backend.get_stats()
    # SGLang's StorageMetrics lives in sglang.srt.observability.metrics_collector, which
    # needs transformers; without it get_stats returns None (SGLang accepts None).
    if stats is not None:
        assert stats.prefetch_pgs == [2] and stats.backup_pgs == [2]
    other, other_pool = attach(model="other/model")      # another model on the same store
    fill_random(other_pool, [0], seed=11)
    assert other.batch_set_v1(["o0"], other_pool.token_indices([0])) == [True]
    assert backend.clear() is True
    assert backend.batch_exists(["s0"]) == 0
    # the whole shared store is cleared, other models' pages too (decision 97), and it says so
    assert not any(f.endswith(".page") for _, _, fs in os.walk(store) for f in fs)
    said = [r.getMessage() for r in caplog.records if "clear()" in r.getMessage()]
    assert len(said) == 1 and "whole store" in said[0] and store in said[0], said
    backend.close()
    backend.close()  # idempotent
    # every call after close() says the backend is closed, not "never registered"
    for call in (lambda: backend.batch_exists(["s0"]),
                 lambda: backend.batch_get_v1(["s0"], pool.token_indices([2])),
                 lambda: backend.batch_set_v1(["s0"], pool.token_indices([2])),
                 lambda: backend.batch_get(["s0"]), lambda: backend.exists("s0")):
        with pytest.raises(RuntimeError, match="backend is closed"):
            call()


def test_hicache_mp_never_imports_sglang():
    """The module imports SGLang only when imported itself: hicache_mp does not."""
    code = ("import sys, hicache_mp, hicache_mp.integrations.sglang.store_import, hicache_mp.cli; "
            "print('sglang' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "False", out.stderr


def _daemon_round_trip(store, queue):
    pool = CpuMHAHostPool(layout="page_first_direct", allocator_type="shm")
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(store), pool)
    try:
        backend.register_mem_pool_host(pool)
        want = fill_random(pool, [1], seed=12)[0]
        ok = backend.batch_set_v1(["d"], pool.token_indices([1]))
        pool.kv_buffer.zero_()
        ok += backend.batch_get_v1(["d"], pool.token_indices([3]))
        same = torch.equal(pool.get_data_page(3 * pool.page_size), want)
        queue.put((ok, same, backend.zero_copy, backend.metrics()["staging_copies"]))
    finally:
        backend.close()
        pool.close()


def test_zero_copy_from_a_daemonic_scheduler_process(store):
    """SGLang runs schedulers as daemon=True children; workers still start and
    inherit the memfd there."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_daemon_round_trip, args=(store, queue), daemon=True)
    proc.start()
    try:
        assert queue.get(timeout=60) == ([True, True], True, True, 0)
    finally:
        proc.join(30)
    assert proc.exitcode == 0


def test_a_storage_dir_list_stripes_and_clear_empties_every_directory(attach, tmp_path):
    """SGLang's extra-config `storage_dir` takes the same comma-separated list as
    --storage-dir: pages spread over the directories, read back byte-exact by a
    second backend on the same list, and clear() removes them from all."""
    dirs = [str(tmp_path / f"nvme{i}") for i in range(2)]
    spec = ",".join(dirs)
    backend, pool = attach(store=spec)
    assert backend.engine.config.storage_dir == spec
    keys = [f"st{i}" for i in range(8)]
    want = fill_random(pool, range(8), seed=21)
    assert backend.batch_set_v1(keys, pool.token_indices(range(8))) == [True] * 8
    on_disk = [sum(f.endswith(".page") for _, _, fs in os.walk(d) for f in fs) for d in dirs]
    assert sum(on_disk) == 8 and all(on_disk), on_disk
    other, pool2 = attach(store=spec)
    assert other.batch_get_v1(keys, pool2.token_indices(range(8))) == [True] * 8
    assert all(torch.equal(pool2.get_data_page(p * pool2.page_size), w) for p, w in zip(range(8), want))
    assert backend.clear() is True
    assert not any(f.endswith(".page") for d in dirs for _, _, fs in os.walk(d) for f in fs)


def test_storage_dir_empty_is_refused_relative_is_resolved(attach, tmp_path, monkeypatch,
                                                          caplog):
    """"storage_dir": "" is a ValueError (as vLLM's tier says), not a silent
    /tmp/hicache_mp; a relative one is resolved against the current directory
    (one INFO line) and the workers get the absolute path; a JSON list in a
    string names its directories."""
    with pytest.raises(ValueError, match="storage_dir"):
        attach(store="")
    caplog.set_level(logging.INFO, logger="hicache_mp.sglang")
    monkeypatch.chdir(tmp_path)
    backend, pool = attach(store="rel/store")
    want = str(tmp_path / "rel" / "store")
    assert backend.storage_dir == want and backend.engine.config.storage_dir == want
    fill_random(pool, [0], seed=2)
    assert backend.batch_set_v1(["r0"], pool.token_indices([0])) == [True]
    assert sum(len(f) for _, _, f in os.walk(want)) == 1
    said = [r.getMessage() for r in caplog.records if "relative" in r.getMessage()]
    assert len(said) == 1 and want in said[0], said
    listed, _ = attach(store='["a", "%s"]' % (tmp_path / "b"))
    assert listed.engine.config.storage_dir == f"{tmp_path / 'a'},{tmp_path / 'b'}"
    assert not [n for n in os.listdir(tmp_path) if n.startswith("[")]


def test_storage_keys_in_the_extra_config_reach_the_engine(attach):
    backend, pool = attach(storage_max_bytes="64M", storage_min_free_bytes=1 << 20,
                           io_depth=2, backup_budget_pages=4, direct_io="off",
                           write_share=0.25)
    cfg = backend.engine.config
    assert (cfg.storage_max_bytes, cfg.storage_min_free_bytes) == (64 << 20, 1 << 20)
    assert (cfg.io_depth, cfg.backup_budget_pages, cfg.direct_io, cfg.write_share) == \
        (2, 4, "off", 0.25)
    m = backend.engine.metrics()
    assert m["io_depth"] == 2 and m["backup_budget_pages"] == 4 and not m["direct_io"]
    # the capacity limit is enforced, not just stored: an evictor keeps the estimate
    assert m["store_bytes_estimate"] is not None
    want = fill_random(pool, [1, 2], seed=3)
    assert backend.batch_set_v1(["k1", "k2"], pool.token_indices([1, 2])) == [True, True]
    assert backend.batch_get_v1(["k1", "k2"], pool.token_indices([5, 6])) == [True, True]
    assert all(torch.equal(pool.get_data_page(p * pool.page_size), w) for p, w in zip([5, 6], want))


@pytest.mark.parametrize("key, value", [("io_depth", 99), ("direct_io", "sometimes"),
                                        ("storage_max_bytes", "lots")])
def test_a_bad_storage_key_is_a_clear_error_before_any_worker(attach, key, value):
    with pytest.raises(ValueError, match=key if key != "storage_max_bytes" else "not a size"):
        attach(**{key: value})


def test_an_unknown_extra_config_key_is_logged(attach, caplog):
    caplog.set_level(logging.WARNING, logger="hicache_mp")
    attach(storage_max_byte="1G")  # the typo a user makes
    lines = [r.getMessage() for r in caplog.records if "not used by hicache_mp" in r.getMessage()]
    assert len(lines) == 1 and "storage_max_byte" in lines[0]


def test_a_hybrid_models_sidecar_pool_is_served_beside_kv(attach):
    """Sidecar pools are served beside the KV pool (tests/integrations/test_sglang_v2.py has the rest)."""
    backend, pool = attach()
    backend.register_mem_host_pool_v2(pool, "kv")  # the primary pool itself is fine
    sidecar = CpuMHAHostPool(layout="layer_first", allocator_type="shm", pages=4)
    try:
        backend.register_mem_host_pool_v2(sidecar, "swa")
        assert set(backend.metrics()["sidecar_pools"]) == {"swa"}
    finally:
        backend.close()
        sidecar.close()
    backend.register_mem_pool_host(pool)
    # The KV path works beside it.
    fill_random(pool, [1], seed=5)
    assert backend.batch_set_v1(["hy-1"], pool.token_indices([1])) == [True]
