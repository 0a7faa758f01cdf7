"""Sidecar pools on SGLang 0.5.23's REAL host pools: refused when they cannot be staged,
and checksummed by default (issue 33, findings 6 and 7).

- A Mamba state page larger than the sidecar staging cap (a Qwen3-Next-sized
  state on SGLang's default allocator) is refused at attach with an error
  naming the page size, the cap and the fixes, with nothing left running; a
  pool left unserved means no KV page is written through the v2 calls (they
  could never be restored).
- With default settings, one flipped byte in a stored Mamba state page is a
  miss on the zero-copy and the staged path, never a hit.
"""
import glob
import os

import pytest
import torch

try:   # the real-pool builders: in the bench package, or as a script module before it
    from hicache_mp.bench.sglang import real_hybrid as real
except ImportError:
    import sglang_real_hybrid as real

try:
    S = real.load()
except Exception as exc:  # ImportError, or a broken module on the chain
    pytest.skip(f"SGLang's host-pool classes cannot be imported here ({exc}); install "
                f"`pip install --no-deps -r .ci/sglang-stack-requirements.txt`",
                allow_module_level=True)

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from test_sglang_v2 import config, keys_for, kv_t, make, mamba_t, page_bytes  # noqa: E402,F401
from workers import naming  # noqa: E402
from workers.stores import open_store  # noqa: E402


class MambaStack:
    """A real KV pool and a real Mamba pool (`allocator`: SGLang's "shm" memfds or
    its default allocator)."""

    def __init__(self, seed=0, **mamba):
        self.kv, self.mamba = real.mha_pool(S, layout="layer_first"), real.mamba_pool(S, **mamba)
        g = torch.Generator().manual_seed(seed)
        real.fill_random(self.kv, g)
        real.fill_random(self.mamba, g)

    def entries(self):
        return [(self.kv, PoolName.KV), (self.mamba, PoolName.MAMBA)]


def page_files(store):
    return glob.glob(os.path.join(store, "??", "??", "*" + naming.PAGE_SUFFIX))


# --- finding 6: a pool that cannot be staged is refused at attach ---------------------
def test_a_state_page_over_the_staging_cap_is_refused_at_attach(make, store):  # noqa: F811
    # 2 layers of fp32 (2, 2048, 2400) per slot: 75.0 MiB a state page, over 64 MiB
    big = MambaStack(temporal=(2, 2048, 2400), slots=1, allocator="default")
    # attached as SGLang's hybrid controller does (test_sglang_v2's `make`)
    b = StorageBackendFactory.create_backend("dynamic", config(store), big.kv)
    b.register_mem_pool_host(big.kv)
    b.register_mem_host_pool_v2(big.kv, PoolName.KV)
    with pytest.raises(ValueError) as err:
        b.register_mem_host_pool_v2(big.mamba, PoolName.MAMBA)
    msg = str(err.value)
    for part in ("mamba", "75.0 MiB", "64.0 MiB", '"sidecar_staging_bytes"', '"76M"',
                 '"allocator": "shm"', "--shm-size"):
        assert part in msg, (part, msg)
    # nothing left running (the autouse fixture checks /dev/shm and processes),
    # and no call writes KV pages for prefixes that could never be restored
    keys = keys_for(2)
    with pytest.raises(RuntimeError):
        b.batch_set_v2([kv_t(big, keys, [0, 1])])
    assert page_files(store) == []


def test_the_cap_is_a_setting_and_a_pool_within_it_is_served(make, store):  # noqa: F811
    small = MambaStack(allocator="default")        # 2 layers: a few hundred bytes a page
    page = make("mp", small).metrics()["sidecar_pools"]["mamba"]["page_bytes"]
    assert page < 1024
    with pytest.raises(ValueError, match=f"{page} bytes"):
        make("mp", MambaStack(allocator="default"), sidecar_staging_bytes=page - 1)
    b = make("mp", MambaStack(allocator="default"), sidecar_staging_bytes=page)
    assert b.metrics()["sidecar_pools"]["mamba"]["zero_copy"] is False


def test_no_kv_page_is_written_while_a_pool_is_unserved(make, store):  # noqa: F811
    s = MambaStack()
    b = make("mp", s)
    b.register_mem_host_pool_v2(object(), "mystery")     # no host pool we know: unserved
    keys = keys_for(2)
    assert b.batch_set_v2([kv_t(s, keys, [0, 1]),
                           PoolTransfer(name="mystery", keys=keys,
                                        host_indices=torch.arange(2))]) == \
        {PoolName.KV: [False] * 2, "mystery": [False] * 2}
    assert b.batch_set_v2([kv_t(s, keys, [0, 1])]) == {PoolName.KV: [False] * 2}
    assert page_files(store) == []


# --- finding 7: a flipped byte in a Mamba state is never a hit ------------------------
@pytest.mark.parametrize("allocator", ["shm", "default"], ids=["zero_copy", "staged"])
def test_a_flipped_byte_in_a_mamba_state_is_a_miss_by_default(make, store, allocator):  # noqa: F811
    src = MambaStack(0, allocator=allocator)
    w = make("mp", src)
    assert w.metrics()["sidecar_pools"]["mamba"]["zero_copy"] is (allocator == "shm")
    keys = keys_for(3)
    assert w.batch_set_v2([kv_t(src, keys, [0, 1, 2]), mamba_t(src, keys[1:2], [1])]) == \
        {PoolName.KV: [True] * 3, PoolName.MAMBA: [True]}
    assert w.batch_set_v2([mamba_t(src, keys[2:], [2])]) == {PoolName.MAMBA: [True]}
    ns = w.hybrid.pools["mamba"].engine.namespace
    path = open_store(store).path(naming.key_digest(f"{keys[2]}.mamba", ns))
    with open(path, "r+b") as f:         # one byte of the payload, the file's size kept
        f.seek(-7, os.SEEK_END)
        b = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))
    w.close()

    dst = MambaStack(5, allocator=allocator)
    r = make("mp", dst)
    before = page_bytes(dst.mamba, 4)
    # the intact page is a hit with its bytes: the check is not a refusal of everything
    assert r.batch_get_v2([mamba_t(dst, keys[1:2], [3])]) == {PoolName.MAMBA: [True]}
    assert torch.equal(page_bytes(dst.mamba, 3), page_bytes(src.mamba, 1))
    assert r.batch_get_v2([mamba_t(dst, keys[2:], [4])]) == {PoolName.MAMBA: [False]}
    if allocator == "default":           # staged: nothing of the bad page reaches the pool
        assert torch.equal(page_bytes(dst.mamba, 4), before)
    assert r.metrics()["sidecar_pools"]["mamba"]["page_bytes"] == len(before)
    # and it is not found again as stored, by the index or by asking the store
    assert r.hybrid.pools["mamba"].present(keys[1:]).tolist() == [True, False]
