"""SGLang meets a faulty store through hicache_mp (issue 23's fault suite).

- SGLang's own `HiCacheStorageFailureInjector` (random delays and failures
  before each storage call, as SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY /
  _FAILURE turn on) wrapped around the HiCacheMP adapter, for a run of
  backups and prefetches from two threads at once, as SGLang's backup and
  prefetch threads call it: dense (v1, zero-copy and staged) and hybrid (v2:
  KV and a Mamba state). Every page reported True holds exactly the bytes
  backed up under its key, every restorable prefix really is restorable, a
  failure is a clean False (or "nothing stored"), and every acknowledged
  page reads back once the injector is gone.
- A hybrid model's Mamba state file damaged on disk (truncated at several
  lengths, grown, its header or, with checksums on, its payload flipped,
  another key's file in its place): its read is a False, the index forgets it,
  and no prefix ending there is restorable any more: a miss, never a wrong
  Mamba state.

The host pools are the stand-ins of tests/integrations (sglang_pool,
sglang_hybrid_pools: their docstrings say why SGLang's own cannot be built on
this CPU machine) on memory from SGLang's own allocators; the adapter,
PoolTransfer and the injector are SGLang's and hicache_mp's own.
"""
import os
import random
import threading
import time

import pytest
import torch

try:
    import sglang.srt.mem_cache.hicache_storage as sgl
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageFailureInjector,
                                                      PoolHitPolicy, PoolName, PoolTransfer)
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
except ImportError as exc:  # noqa: F841
    pytest.skip(f"SGLang is not importable ({exc}); install it with "
                f"`pip install --no-deps -r .ci/sglang-requirements.txt`", allow_module_level=True)

from sglang_hybrid_pools import CpuMambaHostPool  # noqa: E402
from sglang_pool import CpuMHAHostPool  # noqa: E402

from workers import pagefile  # noqa: E402
from faultkit import store_files  # noqa: E402

DYNAMIC = {"backend_name": "hicache_mp", "module_path": "hicache_mp.integrations.sglang",
           "class_name": "HiCacheMP", "interface_v1": 1, "allocator": "shm", "num_workers": 2}
P = 4               # KV page size (tokens)
KV_PAGES = 24       # host pool pages: the writer thread uses the first half, the reader the rest
MAMBA_SLOTS = 16
RUN_S = 0.4         # each thread's run: ~80-200 pages checked true; the tests ask for 20
DELAY_S = 0.003     # the injector's random delay limit
FAIL_P = 0.25       # and failure probability, per call
TRAIL = PoolHitPolicy.TRAILING_PAGES


def _config(store, **extra):
    return sgl.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="Qwen/Qwen3-Next-80B-A3B",
        extra_config={**DYNAMIC, "storage_dir": store, **extra})


class Rank:
    """One rank's pools and its backend, attached as SGLang's controller does;
    `injected` is the backend wrapped in SGLang's failure injector."""

    def __init__(self, store, *, allocator="shm", hybrid=False, **extra):
        self.kv = CpuMHAHostPool(layout="layer_first", page_size=P, pages=KV_PAGES,
                                 allocator_type=allocator)
        self.mamba = CpuMambaHostPool(slots=MAMBA_SLOTS) if hybrid else None
        self.backend = StorageBackendFactory.create_backend(
            "dynamic", _config(store, **extra), self.kv)
        self.injected = HiCacheStorageFailureInjector(self.backend, DELAY_S, FAIL_P)
        self.backend.register_mem_pool_host(self.kv)
        if hybrid:
            self.backend.register_mem_host_pool_v2(self.kv, PoolName.KV)
            self.backend.register_mem_host_pool_v2(self.mamba, PoolName.MAMBA)
            self.backend.on_host_pools_registered()

    def close(self):
        self.backend.close()
        self.kv.close()
        if self.mamba is not None:
            self.mamba.close()


@pytest.fixture
def ranks(store):
    made = []

    def new(**kw):
        r = Rank(kw.pop("store", store), **kw)
        made.append(r)
        return r

    yield new
    for r in made:
        r.close()


def tokens(pages):
    return torch.cat([torch.arange(p * P, (p + 1) * P, dtype=torch.int64) for p in pages])


def kv_bytes(pool, page):
    return pool.get_data_page(page * P, flat=True).contiguous().view(torch.uint8).clone()


def mamba_bytes(pool, slot):
    return pool.get_data_page(slot, flat=True).contiguous().view(torch.uint8).clone()


class Truth:
    """What each key's pages hold (fixed when first written: keys are never
    written twice) and which writes were acknowledged. Shared by both threads."""

    def __init__(self, rank, seed):
        self.rank, self.gen = rank, torch.Generator().manual_seed(seed)
        self.kv: dict[str, torch.Tensor] = {}
        self.mamba: dict[str, torch.Tensor] = {}
        self.kv_acked: set = set()
        self.mamba_acked: set = set()
        self.prefixes: list[list[str]] = []   # prefixes whose KV was acknowledged whole
        self.lock = threading.Lock()
        self.checked = {"true": 0, "false": 0, "restorable": 0}

    def fill_kv(self, keys, pages):
        pool = self.rank.kv
        for k, p in zip(keys, pages):
            flat = torch.randn(pool.get_dummy_flat_data_page().numel(), generator=self.gen)
            pool.set_from_flat_data_page(p * P, flat.to(pool.dtype))
            self.kv[k] = kv_bytes(pool, p)

    def fill_mamba(self, key, slot):
        pool = self.rank.mamba
        pool.temporal_buffer[slot].copy_(torch.randn(pool.temporal_buffer[slot].shape,
                                                     generator=self.gen))
        for c in pool.conv_buffer:
            c[slot].copy_(torch.randn(c[slot].shape, generator=self.gen).to(c.dtype))
        self.mamba[key] = mamba_bytes(pool, slot)

    def poison(self, pages=(), slots=()):
        for p in pages:
            self.rank.kv.kv_buffer[:, :, p * P:(p + 1) * P].fill_(-7)
        for s in slots:
            self.rank.mamba.temporal_buffer[s].fill_(-7)
            for c in self.rank.mamba.conv_buffer:
                c[s].fill_(-7)

    def check_kv(self, keys, pages, answer):
        assert isinstance(answer, list) and len(answer) == len(keys), answer
        for k, p, ok in zip(keys, pages, answer):
            if ok:
                assert torch.equal(kv_bytes(self.rank.kv, p), self.kv[k]), f"wrong bytes for {k}"
        self.checked["true"] += sum(answer)
        self.checked["false"] += len(answer) - sum(answer)

    def check_mamba(self, key, slot, ok):
        if ok:
            assert torch.equal(mamba_bytes(self.rank.mamba, slot), self.mamba[key]), \
                f"a wrong Mamba state for {key}"


def _run_threads(writer, reader, seconds=RUN_S, enough=lambda: True, cap_s=30.0):
    """SGLang's backup and prefetch threads: both call the backend at once, for
    `seconds`, then on until `enough()` (a loaded box may not reach a test's
    minimum counts in the planned time) or `cap_s` in all."""
    errors, stop = [], threading.Event()

    def loop(step):
        rng = random.Random(hash(step.__name__))
        try:
            while not stop.is_set():
                step(rng)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=loop, args=(f,)) for f in (writer, reader)]
    for t in threads:
        t.start()
    stop.wait(seconds)
    deadline = time.monotonic() + cap_s - seconds
    while not stop.is_set() and not enough() and time.monotonic() < deadline:
        stop.wait(0.1)
    stop.set()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("allocator", ["shm", "mmap"])  # zero-copy, and staged through copies
def test_dense_under_sglangs_failure_injector(ranks, allocator):
    rank = ranks(allocator=allocator)
    assert rank.backend.zero_copy is (allocator == "shm")
    inj, truth, serial = rank.injected, Truth(rank, 1), iter(range(10 ** 9))
    half = KV_PAGES // 2

    def writer(rng):
        n = rng.randint(1, 4)
        keys = [f"d{next(serial)}" for _ in range(n)]
        pages = rng.sample(range(half), n)
        truth.fill_kv(keys, pages)
        answer = inj.batch_set_v1(keys, tokens(pages))
        assert isinstance(answer, list) and len(answer) == n, answer
        with truth.lock:
            truth.kv_acked.update(k for k, ok in zip(keys, answer) if ok)

    def reader(rng):
        with truth.lock:
            known = sorted(truth.kv_acked)
        if not known:
            return
        keys = rng.sample(known, min(len(known), rng.randint(1, 4)))
        if rng.random() < 0.3:
            keys.insert(rng.randint(0, len(keys)), f"never-{rng.random()}")
        leading = next((i for i, k in enumerate(keys) if k.startswith("never-")), len(keys))
        found = inj.batch_exists(keys)
        assert found in (0, leading), (found, leading)   # 0: an injected failure
        pages = rng.sample(range(half, KV_PAGES), len(keys))
        truth.poison(pages)
        answer = inj.batch_get_v1(keys, tokens(pages))
        truth.check_kv(keys, pages, answer)
        assert not any(answer) or all(answer[:leading]), (answer, leading)

    _run_threads(writer, reader, enough=lambda: truth.checked["true"] > 20 and
                 truth.checked["false"] > 5)
    # The injector failed calls and the adapter took the rest: both happened.
    assert truth.checked["true"] > 20 and truth.checked["false"] > 5, truth.checked
    _every_acknowledged_kv_page_reads_back(rank, truth)


def _every_acknowledged_kv_page_reads_back(rank, truth):
    acked = sorted(truth.kv_acked)
    for i in range(0, len(acked), 8):
        keys = acked[i:i + 8]
        pages = list(range(len(keys)))
        truth.poison(pages)
        answer = rank.backend.batch_get_v1(keys, tokens(pages))
        assert answer == [True] * len(keys), (keys, answer)
        truth.check_kv(keys, pages, answer)


def _mamba_query():
    return PoolTransfer(name=PoolName.MAMBA, keys=["x"], hit_policy=TRAIL)


def test_hybrid_under_sglangs_failure_injector(ranks):
    rank = ranks(hybrid=True)
    inj, truth, serial = rank.injected, Truth(rank, 2), iter(range(10 ** 9))
    half_kv, half_slots = KV_PAGES // 2, MAMBA_SLOTS // 2

    def writer(rng):
        n = rng.randint(1, 4)
        keys = [f"h{next(serial)}" for _ in range(n)]
        pages = rng.sample(range(half_kv), n)
        slot = rng.randrange(half_slots)
        truth.fill_kv(keys, pages)
        truth.fill_mamba(keys[-1], slot)
        # As SGLang's controller: the sidecar's state first, then the KV pages.
        side = inj.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:],
                                              host_indices=torch.tensor([slot]), hit_policy=TRAIL)])
        kv = inj.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys,
                                            host_indices=tokens(pages))])
        assert set(side) == {PoolName.MAMBA} and len(side[PoolName.MAMBA]) == 1, side
        assert set(kv) == {PoolName.KV} and len(kv[PoolName.KV]) == n, kv
        with truth.lock:
            truth.kv_acked.update(k for k, ok in zip(keys, kv[PoolName.KV]) if ok)
            if side[PoolName.MAMBA][0]:
                truth.mamba_acked.add(keys[-1])
            if all(kv[PoolName.KV]):
                truth.prefixes.append(keys)

    def reader(rng):
        with truth.lock:
            if not truth.prefixes:
                return
            keys = list(rng.choice(truth.prefixes))
            kv_acked, mamba_acked = set(truth.kv_acked), set(truth.mamba_acked)
        r = inj.batch_exists_v2(keys, [_mamba_query()])
        restorable = r.restorable_prefix_pages or []  # None: the injector's empty result
        # Every restorable prefix claimed: its KV pages and its Mamba state were stored.
        for p in restorable:
            assert set(keys[:p]) <= kv_acked and keys[p - 1] in mamba_acked, (p, keys)
        truth.checked["restorable"] += len(restorable)
        pages = rng.sample(range(half_kv, KV_PAGES), len(keys))
        slot = rng.randrange(half_slots, MAMBA_SLOTS)
        truth.poison(pages, [slot])
        got = inj.batch_get_v2([
            PoolTransfer(name=PoolName.KV, keys=keys, host_indices=tokens(pages)),
            PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], host_indices=torch.tensor([slot]),
                         hit_policy=TRAIL)])
        assert set(got) == {PoolName.KV, PoolName.MAMBA}, got
        truth.check_kv(keys, pages, got[PoolName.KV])
        assert len(got[PoolName.MAMBA]) == 1, got
        truth.check_mamba(keys[-1], slot, got[PoolName.MAMBA][0])

    _run_threads(writer, reader, enough=lambda: truth.checked["true"] > 20 and
                 truth.checked["false"] > 5 and truth.checked["restorable"] > 0)
    assert truth.checked["true"] > 20 and truth.checked["false"] > 5, truth.checked
    assert truth.checked["restorable"] > 0, truth.checked
    _every_acknowledged_kv_page_reads_back(rank, truth)
    for key in sorted(truth.mamba_acked):
        truth.poison(slots=[0])
        got = rank.backend.batch_get_v2([PoolTransfer(
            name=PoolName.MAMBA, keys=[key], host_indices=torch.tensor([0]), hit_policy=TRAIL)])
        assert got == {PoolName.MAMBA: [True]}, key
        truth.check_mamba(key, 0, True)


# --- a Mamba state file damaged on disk -------------------------------------------------
def _truncate(n):
    def damage(path, other):
        with open(path, "r+b") as f:
            f.truncate(n if n >= 0 else os.path.getsize(path) + n)
    return damage


def _flip(at):
    def damage(path, other):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(at if at >= 0 else size + at)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x5A]))
    return damage


def _grow(path, other):
    with open(path, "ab") as f:
        f.write(b"\0")


def _swap(path, other):
    os.replace(other, path)  # another key's Mamba state under this key's name


DAMAGE = {
    "empty": _truncate(0), "half_header": _truncate(pagefile.HEADER_SIZE // 2),
    "header_only": _truncate(pagefile.HEADER_SIZE), "short_payload": _truncate(-7),
    "one_byte_more": _grow, "magic": _flip(0), "header_crc_area": _flip(64),
    "payload_with_checksums": _flip(-3), "another_keys_state": _swap,
}


def _mamba_file(rank, key, slot):
    """Back up `key`'s Mamba state from `slot`; the page file that wrote."""
    before = set(store_files(rank.backend.storage_dir)[0])
    got = rank.backend.batch_set_v2([PoolTransfer(
        name=PoolName.MAMBA, keys=[key], host_indices=torch.tensor([slot]), hit_policy=TRAIL)])
    assert got == {PoolName.MAMBA: [True]}
    (path,) = set(store_files(rank.backend.storage_dir)[0]) - before
    return path


def _stored_prefix(rank, truth, tag, n=4):
    """KV pages 0..n-1 and the Mamba state at their end, backed up; (keys, the
    state's page file, another key's state file)."""
    keys = [f"{tag}-{i}" for i in range(n)]
    truth.fill_kv(keys, range(n))
    truth.fill_mamba(keys[-1], 1)
    truth.fill_mamba(f"{tag}-other", 2)
    path = _mamba_file(rank, keys[-1], 1)
    other = _mamba_file(rank, f"{tag}-other", 2)
    assert rank.backend.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys,
                                                   host_indices=tokens(range(n)))]) == \
        {PoolName.KV: [True] * n}
    assert rank.backend.batch_exists_v2(keys, [_mamba_query()]).restorable_prefix_pages == [n]
    return keys, path, other


def _get_state(rank, key, slot):
    return rank.backend.batch_get_v2([PoolTransfer(
        name=PoolName.MAMBA, keys=[key], host_indices=torch.tensor([slot]), hit_policy=TRAIL)])


# Damage that leaves the file its right size: only a read can tell.


def _backed_up_again_is_whole(rank, truth, keys, how):
    truth.fill_mamba(keys[-1], 1)
    assert rank.backend.batch_set_v2([PoolTransfer(
        name=PoolName.MAMBA, keys=keys[-1:], host_indices=torch.tensor([1]),
        hit_policy=TRAIL)]) == {PoolName.MAMBA: [True]}, how
    truth.poison(slots=[5])
    assert _get_state(rank, keys[-1], 5) == {PoolName.MAMBA: [True]}, how
    truth.check_mamba(keys[-1], 5, True)
    assert rank.backend.batch_exists_v2(keys, [_mamba_query()]).restorable_prefix_pages == \
        [len(keys)], how


def _restorable(rank, keys):
    return rank.backend.batch_exists_v2(keys, [_mamba_query()]).restorable_prefix_pages


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_damaged_mamba_state_file_is_a_miss_never_a_wrong_state(ranks, zero_copy):
    """Each kind of damage on its own prefix: the read is False (staged, the
    slot untouched), and so is every later read, whatever exists() said in
    between. No damaged state is claimed restorable after its read failed,
    whether the damage changed the file's size or not (a probe finds a
    right-sized file again: the index distrusts it), and a new backup makes
    the state whole again."""
    rank = ranks(hybrid=True, zero_copy=zero_copy, write_checksum=True, num_workers=1)
    truth = Truth(rank, 3)
    for how, damage in sorted(DAMAGE.items()):
        keys, path, other = _stored_prefix(rank, truth, how)
        damage(path, other)
        for _ in range(2):
            truth.poison(slots=[5])
            before = mamba_bytes(rank.mamba, 5)
            assert _get_state(rank, keys[-1], 5) == {PoolName.MAMBA: [False]}, how
            if not zero_copy:
                assert torch.equal(mamba_bytes(rank.mamba, 5), before), how  # staged: untouched
            time.sleep(0.05)  # a probe's answer lands in the index by the next call
            assert _restorable(rank, keys) == [], how
        _backed_up_again_is_whole(rank, truth, keys, how)


def test_with_quarantine_every_damaged_state_is_a_miss_until_backed_up_again(ranks):
    """quarantine_bad_files moves the damaged file aside when its read fails:
    whatever the damage, no prefix ending there is claimed restorable any
    more, and a new backup makes the state whole again."""
    rank = ranks(hybrid=True, write_checksum=True, quarantine_bad_files=True, num_workers=1)
    truth = Truth(rank, 5)
    for how, damage in sorted(DAMAGE.items()):
        keys, path, other = _stored_prefix(rank, truth, how)
        damage(path, other)
        assert _get_state(rank, keys[-1], 5) == {PoolName.MAMBA: [False]}, how
        for _ in range(2):  # a probe of the key the index forgot finds nothing either
            assert _restorable(rank, keys) == [], how
            time.sleep(0.05)
        _backed_up_again_is_whole(rank, truth, keys, how)


def _damaged_then_asked(rank, truth, how):
    keys, path, other = _stored_prefix(rank, truth, how)
    DAMAGE[how](path, other)
    assert _get_state(rank, keys[-1], 5) == {PoolName.MAMBA: [False]}, how
    for _ in range(3):
        restorable = _restorable(rank, keys)
        time.sleep(0.05)  # a probe's answer lands in the index by the next call
    return keys, restorable


def test_a_right_sized_damaged_state_is_not_claimed_again_after_its_read_failed(ranks):
    """A right-sized file with a bad header: the probe finds it again by name
    and size, and the index does not believe it (hicache_mp.engine.index)."""
    rank = ranks(hybrid=True, num_workers=1)
    keys, restorable = _damaged_then_asked(rank, Truth(rank, 6), "magic")
    assert restorable == [], restorable


def test_a_right_sized_damaged_state_backed_up_again_is_whole(ranks):
    """... and a new backup of it is written, not skipped as stored."""
    rank = ranks(hybrid=True, num_workers=1)
    truth = Truth(rank, 7)
    keys, _ = _damaged_then_asked(rank, truth, "magic")
    _backed_up_again_is_whole(rank, truth, keys, "magic")


def test_a_damaged_mamba_state_file_found_by_a_fresh_rank_is_a_miss(ranks, store):
    """Another server (a restart, another node) meets the damage first: its
    read is a miss, and a state cut short is not claimed restorable."""
    first = ranks(hybrid=True, num_workers=1)
    truth = Truth(first, 4)
    keys, path, other = _stored_prefix(first, truth, "fresh")
    _truncate(pagefile.HEADER_SIZE + 1)(path, other)
    fresh = ranks(hybrid=True, num_workers=1)
    fresh.backend.batch_exists_v2(keys, [_mamba_query()])
    assert _get_state(fresh, keys[-1], 5) == {PoolName.MAMBA: [False]}
    for _ in range(2):
        time.sleep(0.05)
        r = fresh.backend.batch_exists_v2(keys, [_mamba_query()])
        assert r.restorable_prefix_pages == [], r.restorable_prefix_pages
