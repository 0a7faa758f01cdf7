"""HiCacheMP's v2 interface (hybrid models) through the real SGLang package.

SGLang's own PoolTransfer, PoolTransferResult, PoolHitPolicy, PoolName,
HiCacheStorageConfig, StorageBackendFactory, HiCacheFile (the reference for
every hit-policy answer and every byte read) and alloc_shm are used for real.
The host pools are the stand-ins of `sglang_hybrid_pools` (their docstring says
why SGLang's own cannot be built on this CPU machine).
"""
import glob
import os
import shutil

import pytest
import torch

try:
    import sglang.srt.mem_cache.hicache_storage as sgl
    from sglang.srt.mem_cache.hicache_storage import (PoolHitPolicy, PoolName, PoolTransfer,
                                                      PoolTransferResult)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as exc:  # noqa: F841
    pytest.skip(f"SGLang is not importable ({exc}); install it with "
                f"`pip install --no-deps -r .ci/sglang-requirements.txt`", allow_module_level=True)

from sglang_hybrid_pools import (CpuDSAIndexerHostPool, CpuMambaHostPool,  # noqa: E402
                                 CpuMHAHostPool, CpuMLAHostPool, fill_random_mha)

from hicache_mp.integrations.sglang import sidecar_layouts  # noqa: E402
from workers import naming  # noqa: E402

DYNAMIC = {"backend_name": "hicache_mp", "module_path": "hicache_mp.integrations.sglang",
           "class_name": "HiCacheMP", "interface_v1": 1, "allocator": "shm", "num_workers": 1}
P = 4          # KV page size (tokens)
ALL, TRAIL, GROUPS = (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES,
                      PoolHitPolicy.BLOCK_GROUPS)


def config(store, *, mla=False, tp_rank=0, tp_size=1, **extra):
    return sgl.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="Qwen/Qwen3-Next-80B-A3B", extra_config={**DYNAMIC, "storage_dir": store,
                                                             "file_storage_path": store, **extra})


class Stack:
    """One rank's host pools of a hybrid model: KV + Mamba + SWA + DSA indexer + a
    DeepSeek V4 compressed pool, filled with random bytes."""

    def __init__(self, seed=0, kv_layout="layer_first"):
        g = torch.Generator().manual_seed(seed)
        self.kv = CpuMHAHostPool(layout=kv_layout, page_size=P, pages=12)
        self.mamba = CpuMambaHostPool(slots=8)
        self.swa = CpuMHAHostPool(layout="page_first", page_size=P, pages=12, layer_num=2)
        self.indexer = CpuDSAIndexerHostPool(page_size=P, pages=12)
        self.c4 = CpuMLAHostPool(page_size=P, pages=12)
        fill_random_mha(self.kv, g)
        fill_random_mha(self.swa, g)
        for p in (self.mamba, self.indexer, self.c4):
            p.fill_random(g)

    def entries(self):
        return [(self.kv, PoolName.KV), (self.mamba, PoolName.MAMBA), (self.swa, PoolName.SWA),
                (self.indexer, PoolName.INDEXER), (self.c4, PoolName.DEEPSEEK_V4_C4)]

    def close(self):
        for pool, _ in self.entries():
            pool.close()


@pytest.fixture
def make(store):
    """make(kind, stack, **cfg) -> backend, attached as SGLang's hybrid controller
    does: factory, register_mem_pool_host(KV), the v2 burst, on_host_pools_registered."""
    made = []

    def build(kind, stack, store_dir=None, **cfg):
        d = store_dir or store
        if kind == "file":
            b = sgl.HiCacheFile(config(d, **cfg))
        else:
            b = StorageBackendFactory.create_backend("dynamic", config(d, **cfg), stack.kv)
        b.register_mem_pool_host(stack.kv)
        for pool, name in stack.entries():
            b.register_mem_host_pool_v2(pool, name)
        b.on_host_pools_registered()
        made.append(b)
        return b

    yield build
    for b in made:
        if hasattr(b, "close"):
            b.close()


@pytest.fixture
def stacks():
    made = []

    def new(seed=0, **kw):
        s = Stack(seed, **kw)
        made.append(s)
        return s

    yield new
    for s in made:
        s.close()


def tokens(pool, pages):
    """SGLang's host_indices for whole pages: page_size token slots per page."""
    P_ = pool.page_size
    return torch.cat([torch.arange(p * P_, (p + 1) * P_, dtype=torch.int64) for p in pages])


def slot_tensor(slots):
    return torch.tensor(list(slots), dtype=torch.int64)


def keys_for(n, tag="h"):
    return [f"{tag}{i:04d}" for i in range(n)]


def kv_t(stack, keys, pages):
    return PoolTransfer(name=PoolName.KV, keys=keys, host_indices=tokens(stack.kv, pages))


def tok_t(name, pool, keys, pages, policy=ALL):
    return PoolTransfer(name=name, keys=keys, host_indices=tokens(pool, pages),
                        hit_policy=policy)


def mamba_t(stack, keys, slots):
    return PoolTransfer(name=PoolName.MAMBA, keys=keys,
                        host_indices=slot_tensor(slots), hit_policy=TRAIL)


def page_bytes(pool, index):
    return pool.get_data_page(index, flat=True).contiguous().view(torch.uint8).clone()


# --- layouts: the batched copies are SGLang's own flat pages ---------------------
@pytest.mark.parametrize("kind", ["mamba", "mamba_direct", "mha_layer_first", "mha_page_first",
                                  "mha_page_first_direct", "mha_page_head", "indexer_page_first",
                                  "indexer_layer_first", "mla_layer_first", "mla_page_first",
                                  "mla_page_first_direct"])
def test_batched_layout_matches_sglang_pages(kind):
    g = torch.Generator().manual_seed(1)
    if kind.startswith("mamba"):
        pool = CpuMambaHostPool(layout="page_first_direct" if kind.endswith("direct")
                                else "page_first")
        pool.fill_random(g)
        index = torch.tensor([5, 0, 3])
    else:
        family, layout = kind.split("_", 1)
        if family == "mha":
            pool = CpuMHAHostPool(layout=layout, page_size=P, pages=6)
            fill_random_mha(pool, g)
        elif family == "indexer":
            pool = CpuDSAIndexerHostPool(layout=layout, page_size=P, pages=6)
            pool.fill_random(g)
        else:
            pool = CpuMLAHostPool(layout=layout, page_size=P, pages=6)
            pool.fill_random(g)
        index = torch.tensor([5 * P, 0, 3 * P])
    try:
        layout = sidecar_layouts.plan(pool)
        assert layout.batched, layout.describe()
        out = torch.zeros(3, layout.page_bytes, dtype=torch.uint8)
        layout.gather(index, out)
        for i, idx in enumerate(index.tolist()):
            assert torch.equal(out[i], page_bytes(pool, idx)), (kind, i)
        # scatter puts the pages back elsewhere: page 5 -> 1, 0 -> 2, 3 -> 4
        dst = index.clone()
        dst[:] = torch.tensor([1, 2, 4]) * (1 if kind.startswith("mamba") else P)
        layout.scatter(dst, out)
        for i in range(3):
            assert torch.equal(page_bytes(pool, int(dst[i])), out[i]), (kind, i)
    finally:
        pool.close()


# --- round trips per pool kind ---------------------------------------------------
def test_roundtrip_every_pool_kind(make, stacks):
    src, dst = stacks(0), stacks(1)
    b = make("mp", src)
    keys = keys_for(3)
    pages = [2, 5, 7]
    w = b.batch_set_v2([kv_t(src, keys, pages), mamba_t(src, keys[-1:], [6]),
                        tok_t(PoolName.SWA, src.swa, keys, pages),
                        tok_t(PoolName.INDEXER, src.indexer, keys, pages),
                        tok_t(PoolName.DEEPSEEK_V4_C4, src.c4, keys, pages)])
    assert w == {PoolName.KV: [True] * 3, PoolName.MAMBA: [True],
                 PoolName.SWA: [True] * 3, PoolName.INDEXER: [True] * 3,
                 PoolName.DEEPSEEK_V4_C4: [True] * 3}
    # read through a second backend into another rank's pools (other slots)
    b2 = make("mp", dst)
    into = [0, 1, 3]
    r = b2.batch_get_v2([mamba_t(dst, keys[-1:], [2]),
                         tok_t(PoolName.SWA, dst.swa, keys, into),
                         tok_t(PoolName.INDEXER, dst.indexer, keys, into),
                         tok_t(PoolName.DEEPSEEK_V4_C4, dst.c4, keys, into)])
    assert all(all(v) for v in r.values()) and len(r) == 4
    assert b2.batch_get_v1(keys, tokens(dst.kv, into)) == [True] * 3
    assert torch.equal(page_bytes(dst.mamba, 2), page_bytes(src.mamba, 6))
    for a, z in zip(pages, into):
        for name in ("kv", "swa", "indexer", "c4"):
            assert torch.equal(page_bytes(getattr(dst, name), z * P),
                               page_bytes(getattr(src, name), a * P)), (name, a)
    m = b2.metrics()
    assert set(m["sidecar_pools"]) == {"mamba", "swa", "indexer", "deepseek_v4_c4"}
    assert all(p["batched"] for p in m["sidecar_pools"].values())
    assert m["sidecar_unserved"] == {}


# --- the differential test against SGLang's file backend -----------------------------
def write_scenario(b, s, keys):
    """The same sequence of writes, sidecars before KV as SGLang's controller does:
    KV for 8 pages; Mamba states at the ends of prefixes 3, 5 and 8; an SWA window
    of 2 pages at the ends of prefixes 1 (one page: the window is cut at the
    start), 4 and 8; the indexer for pages 0..5 only."""
    n = len(keys)
    pages = list(range(n))
    out = []
    for end in (3, 5, 8):
        out.append(b.batch_set_v2([mamba_t(s, keys[end - 1:end], [end - 1])]))
    for end in (1, 4, 8):
        start = max(0, end - 2)
        out.append(b.batch_set_v2([tok_t(PoolName.SWA, s.swa, keys[start:end],
                                         pages[start:end], TRAIL)]))
    out.append(b.batch_set_v2([tok_t(PoolName.INDEXER, s.indexer, keys[:6], pages[:6])]))
    out.append(b.batch_set_v2([kv_t(s, keys, pages)]))
    return out


def queries(s, keys):
    """(keys, pool_transfers) of several hit queries, placeholder keys for TRAILING_PAGES."""
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=TRAIL)
    swa = PoolTransfer(name=PoolName.SWA, keys=["x", "y"], hit_policy=TRAIL)
    indexer = PoolTransfer(name=PoolName.INDEXER, hit_policy=ALL)
    return [(keys, [mamba]), (keys, [swa]), (keys, [indexer]), (keys, [mamba, swa]),
            (keys, [indexer, mamba]), (keys, [mamba, swa, indexer]), (keys[:6], [mamba]),
            (keys[:7], [swa]), (keys + ["zz0", "zz1"], [mamba]), (["nope"] + keys, [mamba]),
            (keys, [])]


def assert_same_hits(file_backend, mp_backend, query_list) -> None:
    """Every hit query answered by hicache_mp exactly as by SGLang's `file`."""
    for q_keys, transfers in query_list:
        want = file_backend.batch_exists_v2(q_keys, transfers)
        got = mp_backend.batch_exists_v2(q_keys, transfers)
        assert isinstance(got, PoolTransferResult)
        assert (got.kv_hit_pages, got.extra_pool_hit_pages, got.restorable_prefix_pages) == \
               (want.kv_hit_pages, want.extra_pool_hit_pages, want.restorable_prefix_pages), \
            ([t.name for t in transfers], len(q_keys))


def test_same_answers_and_bytes_as_sglang_file_backend(make, stacks, tmp_path):
    keys = keys_for(8)
    src_f, src_m = stacks(0), stacks(0)
    fb = make("file", src_f, store_dir=str(tmp_path / "file"))
    mb = make("mp", src_m, store_dir=str(tmp_path / "mp"))
    assert write_scenario(fb, src_f, keys) == write_scenario(mb, src_m, keys)
    assert_same_hits(fb, mb, queries(src_m, keys))
    # reads: the restorable prefix 5 (KV 0..4, indexer, Mamba at 5, SWA at 5 = missing),
    # plus mismatched and unknown keys, into fresh pools of both backends
    dst_f, dst_m = stacks(7), stacks(7)
    fb2 = make("file", dst_f, store_dir=str(tmp_path / "file"))
    mb2 = make("mp", dst_m, store_dir=str(tmp_path / "mp"))
    into = [6, 7, 8, 9, 10, 11]

    def reads(b, s):
        kv = b.batch_get_v2([kv_t(s, keys[:6], into)])
        side = b.batch_get_v2([
            tok_t(PoolName.INDEXER, s.indexer, keys[:6], into),
            mamba_t(s, keys[4:5], [3]),
            tok_t(PoolName.SWA, s.swa, keys[3:5], into[:2], TRAIL),
            tok_t(PoolName.DEEPSEEK_V4_C4, s.c4, keys[:2], into[:2]),
            PoolTransfer(name=PoolName.MAMBA, keys=keys[:2], host_indices=torch.tensor([1])),
        ])
        return kv, side

    assert reads(fb2, dst_f) == reads(mb2, dst_m)
    for name in ("kv", "swa", "indexer", "c4"):
        for z in into:
            assert torch.equal(page_bytes(getattr(dst_f, name), z * P),
                               page_bytes(getattr(dst_m, name), z * P)), (name, z)
    for slot in range(8):
        assert torch.equal(page_bytes(dst_f.mamba, slot), page_bytes(dst_m.mamba, slot))


def test_kv_without_its_sidecar_is_not_restorable(make, stacks):
    """A backup's completion counts KV only: KV present, Mamba state missing
    (its write failed or its file went) -> no restorable prefix claims it."""
    s = stacks(0)
    b = make("mp", s)
    keys = keys_for(4)
    assert b.batch_set_v2([kv_t(s, keys, range(4))]) == {PoolName.KV: [True] * 4}
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=TRAIL)
    r = b.batch_exists_v2(keys, [mamba])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])
    assert b.batch_set_v2([mamba_t(s, keys[1:2], [1])]) == {PoolName.MAMBA: [True]}
    r = b.batch_exists_v2(keys, [mamba])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages) == \
           (2, {PoolName.KV: 4, PoolName.MAMBA: 2}, [2])


# --- faults: missing pages, mismatched indices, foreign files --------------------------
def test_missing_sidecar_page_is_false_never_an_exception(make, stacks):
    s = stacks(0)
    b = make("mp", s)
    keys = keys_for(3, "never")
    before = page_bytes(s.swa, 0)
    r = b.batch_get_v2([tok_t(PoolName.SWA, s.swa, keys, [0, 1, 2]),
                        mamba_t(s, keys[:1], [0]),
                        PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                     host_indices=tokens(s.indexer, [0])),  # too few
                        PoolTransfer(name="not_registered", keys=keys,
                                     host_indices=torch.arange(3))])
    assert r == {PoolName.SWA: [False] * 3, PoolName.MAMBA: [False],
                 PoolName.INDEXER: [False] * 3, "not_registered": [False] * 3}
    assert torch.equal(page_bytes(s.swa, 0), before)
    # a written page followed by a missing one: only the leading run is True
    b.batch_set_v2([tok_t(PoolName.SWA, s.swa, keys[:1], [0])])
    r = b.batch_get_v2([tok_t(PoolName.SWA, s.swa, keys, [3, 4, 5])])
    assert r == {PoolName.SWA: [True, False, False]}
    assert torch.equal(page_bytes(s.swa, 3 * P), before)


def test_zero_copy_page_off_a_page_boundary_is_false_and_moves_nothing(make, stacks):
    """Zero-copy moves whole pages: host indices of a page that do not start on a
    page boundary answer False (logged), never the neighbouring page."""
    s = stacks(0)
    b = make("mp", s)
    assert b.metrics()["sidecar_pools"]["swa"]["zero_copy"]
    keys = keys_for(2, "odd")
    assert b.batch_set_v2([tok_t(PoolName.SWA, s.swa, keys, [1, 2])]) == \
        {PoolName.SWA: [True, True]}
    before = [page_bytes(s.swa, z * P) for z in range(6)]
    odd = torch.arange(2 * P, dtype=torch.int64) + 4 * P + 1   # pages 4-5, shifted by one
    r = b.batch_get_v2([PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=odd,
                                     hit_policy=ALL)])
    assert r == {PoolName.SWA: [False, False]}
    assert all(torch.equal(page_bytes(s.swa, z * P), before[z]) for z in range(6))
    assert b.batch_set_v2([PoolTransfer(name=PoolName.SWA, keys=keys_for(2, "odd2"),
                                        host_indices=odd, hit_policy=ALL)]) == \
        {PoolName.SWA: [False, False]}


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_file_of_one_pool_is_never_read_as_anothers(make, stacks, store, zero_copy):
    """Two pools of the same page byte size (SWA and a draft SWA pool): one
    pool's file put where the other's would be is refused. Staged, the slot is
    untouched; zero-copy, the payload lands in the slot before the header is
    checked (one preadv, as for KV pages), so what is promised is the answer:
    SGLang uses only the leading pages that were read."""
    s = stacks(0)
    draft = CpuMHAHostPool(layout="page_first", page_size=P, pages=12, layer_num=2)
    try:
        b = make("mp", s, zero_copy=zero_copy)
        assert b.metrics()["sidecar_pools"]["swa"]["zero_copy"] is zero_copy
        b.register_mem_host_pool_v2(draft, PoolName.DRAFT_SWA)
        before = page_bytes(draft, 0)
        key = "shared-hash"
        assert b.batch_set_v2([tok_t(PoolName.SWA, s.swa, [key], [1])]) == {PoolName.SWA: [True]}
        swa_eng = b.hybrid.pools["swa"].engine
        draft_eng = b.hybrid.pools["draft_swa"].engine
        assert swa_eng.config.host_pool_pages and draft_eng.namespace != swa_eng.namespace
        src = naming.page_path(store, naming.key_digest(f"{key}.swa", swa_eng.namespace))
        dst = naming.page_path(store, naming.key_digest(f"{key}.draft_swa", draft_eng.namespace))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        r = b.batch_get_v2([tok_t(PoolName.DRAFT_SWA, draft, [key], [0])])
        assert r == {PoolName.DRAFT_SWA: [False]}
        if not zero_copy:
            assert torch.equal(page_bytes(draft, 0), before)
    finally:
        draft.close()


# --- names: Mamba keys carry the TP rank, MLA KV and indexer keys do not ---------------
def test_mla_shares_kv_and_indexer_but_not_mamba_across_tp_ranks(make, stacks):
    s0, s1 = stacks(0), stacks(1)
    r0 = make("mp", s0, mla=True, tp_rank=0, tp_size=2)
    r1 = make("mp", s1, mla=True, tp_rank=1, tp_size=2)
    keys = keys_for(2)
    r0.batch_set_v2([mamba_t(s0, keys[1:], [0]),
                     tok_t(PoolName.INDEXER, s0.indexer, keys, [0, 1]), kv_t(s0, keys, [0, 1])])
    indexer = PoolTransfer(name=PoolName.INDEXER, hit_policy=ALL)
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=TRAIL)
    assert r1.batch_exists_v2(keys, [indexer]).kv_hit_pages == 2
    assert r1.batch_exists_v2(keys, [mamba]).kv_hit_pages == 0
    assert r0.batch_exists_v2(keys, [mamba]).kv_hit_pages == 2


# --- BLOCK_GROUPS (DeepSeek V4 compressed blocks) -------------------------------------
def test_block_groups_verdict_never_gates_the_kv_hit(make, stacks):
    s = stacks(0)
    b = make("mp", s)
    keys = keys_for(8)
    b.batch_set_v2([kv_t(s, keys, range(8))])
    # compressed pages present for the first 5 keys: groups of 2 keys, 4 pages a block
    b.batch_set_v2([tok_t(PoolName.DEEPSEEK_V4_C4, s.c4, keys[:5], range(5))])
    t = PoolTransfer(name=PoolName.DEEPSEEK_V4_C4, hit_policy=GROUPS, keys=keys[:6],
                     block_pages=4, group_pages=2)
    r = b.batch_exists_v2(keys, [t])
    # groups (0,1) and (2,3) complete, (4,5) not: 2 groups * 4 pages
    assert (r.kv_hit_pages, r.extra_pool_hit_pages[PoolName.DEEPSEEK_V4_C4]) == (8, 8)
    t.block_pages = 3
    r = b.batch_exists_v2(keys, [t])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages[PoolName.DEEPSEEK_V4_C4]) == (8, 6)
    t.group_pages = 0
    with pytest.raises(ValueError, match="group_pages"):
        b.batch_exists_v2(keys, [t])


# --- attach: nothing refused, re-attach, nothing left behind ----------------------------
def test_no_pool_refused_and_an_unreadable_one_is_never_restored(make, stacks, store):
    """An object that is no host pool at all is not refused (refusing after
    SGLang's attach left its threads running): it is served as "not stored"."""
    s = stacks(0)
    b = make("mp", s)
    workers = len(b.metrics()["sidecar_pools"])
    b.register_mem_host_pool_v2(object(), "mystery")
    m = b.metrics()
    assert "mystery" in m["sidecar_unserved"] and len(m["sidecar_pools"]) == workers
    keys = keys_for(2)
    b.batch_set_v2([kv_t(s, keys, [0, 1])])
    assert b.batch_set_v2([PoolTransfer(name="mystery", keys=keys,
                                        host_indices=torch.arange(2))]) == {"mystery": [False] * 2}
    r = b.batch_exists_v2(keys, [PoolTransfer(name="mystery", hit_policy=ALL)])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])


def test_reattach_registers_again_and_close_leaves_nothing(make, stacks, store):
    s = stacks(0)
    b = make("mp", s)
    keys = keys_for(2)
    b.batch_set_v2([mamba_t(s, keys[1:], [3]), kv_t(s, keys, [0, 1])])
    first = b.hybrid.pools["mamba"].engine
    # SGLang's re-attach: register_mem_pool_host, then every pool again
    b.register_mem_pool_host(s.kv)
    assert first.closed and b.hybrid.pools == {}
    for pool, name in s.entries():
        b.register_mem_host_pool_v2(pool, name)
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=TRAIL)
    assert b.batch_exists_v2(keys, [mamba]).kv_hit_pages == 2
    # a dynamic sidecar registered at runtime under an existing name replaces it
    old = b.hybrid.pools["swa"].engine
    b.register_mem_host_pool_v2(s.swa, PoolName.SWA)
    assert old.closed and not b.hybrid.pools["swa"].engine.closed
    engines = [b.engine] + b.hybrid.engines()
    assert len(engines) == 5          # KV + four sidecar pools (old ones already closed)
    b.close()
    assert all(e.closed for e in engines)   # the autouse fixture checks /dev/shm and processes
    assert not glob.glob(os.path.join(store, "**", "*.tmp.*"), recursive=True)


# --- zero-copy sidecars: workers map the pool's memfd -----------------------------------
def test_page_major_memfd_pools_are_zero_copy_and_their_files_read_staged(make, stacks,
                                                                          tmp_path):
    """Every pool on a memfd is read and written in place: the DSA indexer and
    MHA/MLA page_first_direct pools (one run per page, or K and V), a Mamba
    state (temporal, conv), token-major page_first (K and V runs of a page's
    tokens) and layer_first (one run per K/V and layer). A page written
    zero-copy reads back on the staged path ("zero_copy": false) byte for
    byte, and back."""
    keys = keys_for(3)
    src = stacks(0)
    swa_d = CpuMHAHostPool(layout="page_first_direct", page_size=P, pages=12, layer_num=2)
    mla_d = CpuMLAHostPool(layout="page_first_direct", page_size=P, pages=12)
    dst_swa = CpuMHAHostPool(layout="page_first_direct", page_size=P, pages=12, layer_num=2)
    dst_mla = CpuMLAHostPool(layout="page_first_direct", page_size=P, pages=12)
    try:
        g = torch.Generator().manual_seed(4)
        fill_random_mha(swa_d, g)
        mla_d.fill_random(g)
        store = str(tmp_path / "s")
        b = make("mp", src, store_dir=store)
        b.register_mem_host_pool_v2(swa_d, PoolName.DRAFT_SWA)
        b.register_mem_host_pool_v2(mla_d, PoolName.DEEPSEEK_V4_C128)
        zc = {n: p["zero_copy"] for n, p in b.metrics()["sidecar_pools"].items()}
        assert zc == {"indexer": True, "draft_swa": True, "deepseek_v4_c128": True,
                      "mamba": True, "swa": True, "deepseek_v4_c4": True}
        w = b.batch_set_v2([tok_t(PoolName.INDEXER, src.indexer, keys, [1, 2, 3]),
                            tok_t(PoolName.DRAFT_SWA, swa_d, keys, [1, 2, 3]),
                            tok_t(PoolName.DEEPSEEK_V4_C128, mla_d, keys, [1, 2, 3])])
        assert all(v == [True] * 3 for v in w.values())
        # the staged path of another backend reads them
        dst = stacks(9)
        b2 = make("mp", dst, store_dir=store, zero_copy=False)
        b2.register_mem_host_pool_v2(dst_swa, PoolName.DRAFT_SWA)
        b2.register_mem_host_pool_v2(dst_mla, PoolName.DEEPSEEK_V4_C128)
        assert not any(p["zero_copy"] for p in b2.metrics()["sidecar_pools"].values())
        r = b2.batch_get_v2([tok_t(PoolName.INDEXER, dst.indexer, keys, [5, 6, 7]),
                             tok_t(PoolName.DRAFT_SWA, dst_swa, keys, [5, 6, 7]),
                             tok_t(PoolName.DEEPSEEK_V4_C128, dst_mla, keys, [5, 6, 7])])
        assert all(v == [True] * 3 for v in r.values())
        for a, z in zip([1, 2, 3], [5, 6, 7]):
            assert torch.equal(page_bytes(dst.indexer, z * P), page_bytes(src.indexer, a * P))
            assert torch.equal(page_bytes(dst_swa, z * P), page_bytes(swa_d, a * P))
            assert torch.equal(page_bytes(dst_mla, z * P), page_bytes(mla_d, a * P))
        # staged writes read back zero-copy
        k2 = keys_for(2, "staged")
        assert b2.batch_set_v2([tok_t(PoolName.DRAFT_SWA, dst_swa, k2, [5, 6])]) == \
            {PoolName.DRAFT_SWA: [True, True]}
        assert b.batch_get_v2([tok_t(PoolName.DRAFT_SWA, swa_d, k2, [9, 10])]) == \
            {PoolName.DRAFT_SWA: [True, True]}
        assert torch.equal(page_bytes(swa_d, 9 * P), page_bytes(dst_swa, 5 * P))
        assert torch.equal(page_bytes(swa_d, 10 * P), page_bytes(dst_swa, 6 * P))
    finally:
        for p in (swa_d, mla_d, dst_swa, dst_mla):
            p.close()


def test_sidecar_engines_count_against_the_node_budget(make, stacks, tmp_path, monkeypatch):
    """With auto workers, each sidecar engine registers in the node's budget as
    an auxiliary of its rank (hicache_mp.engine.nodebudget): at most 2 workers, taken
    from what the KV engine left, never a scheduler of its own."""
    from hicache_mp.engine.nodebudget import NODE_CORES_ENV, NODE_DIR_ENV, live_shares
    node = str(tmp_path / "node")
    monkeypatch.setenv(NODE_DIR_ENV, node)
    monkeypatch.setenv(NODE_CORES_ENV, "16")
    b = make("mp", stacks(0), num_workers=0, node_engines=2)
    kv_workers = b.engine.worker_count()
    assert kv_workers == 6                       # (16 - 2 x 2 for the schedulers) // 2
    side = {n: p["workers"] for n, p in b.metrics()["sidecar_pools"].items()}
    assert set(side) == {"mamba", "swa", "indexer", "deepseek_v4_c4"}
    # registered one by one: 2, 2, 2 of the 6 left, then the minimum of one
    assert sorted(side.values()) == [1, 2, 2, 2], side
    live = live_shares(node, prune=False)
    assert len(live) == 1 + len(side)
    # the budget, and the one-worker minimum of the last sidecar over it
    assert sum(live.values()) == kv_workers + sum(side.values()) == 16 - 2 * 2 + 1
    b.close()
    assert not os.path.exists(node)
