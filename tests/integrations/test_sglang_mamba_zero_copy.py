"""SGLang 0.5.23's REAL MambaPoolHost on the shm allocator, served zero-copy.

A Mamba state is several tensors, each its own memfd (temporal, every conv
buffer, every extra checkpoint buffer): the workers map them all and move a
state as one run per tensor (shm.partpool), in SGLang's flat page order, so
a state written on the staged path ("zero_copy": false) reads zero-copy byte
for byte, and back. Built on CPU by hicache_mp/bench/sglang/real_hybrid.py; skipped,
naming the missing module, where the pool classes cannot be imported.
"""
import pytest
import torch

from hicache_mp.bench.sglang import real_hybrid as real  # noqa: E402
from test_sglang_v2_real_pools import S  # noqa: E402  (skips this module where it skips)

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402

from test_sglang_v2 import keys_for, make, mamba_t, page_bytes  # noqa: E402,F401

SLOTS = 8


class MambaStack:
    """A real KV pool and a real Mamba pool: fp32 temporal, two bf16 conv
    buffers and an int32 extra checkpoint buffer: four memfds."""

    def __init__(self, seed, layout="page_first"):
        g = torch.Generator().manual_seed(seed)
        self.kv = real.mha_pool(S, layout="layer_first")
        self.mamba = real.mamba_pool(S, slots=SLOTS, layout=layout, conv=((3, 8), (5, 4)),
                                     extra=(((6,), torch.int32),))
        for pool, _ in self.entries():
            real.fill_random(pool, g)

    def entries(self):
        return [(self.kv, PoolName.KV), (self.mamba, PoolName.MAMBA)]


def states(stack):
    return [page_bytes(stack.mamba, s) for s in range(SLOTS)]


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mamba_state_is_zero_copy_and_byte_exact_both_ways(make, tmp_path, layout):  # noqa: F811
    store = str(tmp_path / "s")
    src, dst = MambaStack(0, layout), MambaStack(9, layout)
    assert len(src.mamba.slot_state_buffers) == 1 and len(src.mamba.allocator.fds) >= 4
    b = make("mp", src, store_dir=store)
    m = b.metrics()["sidecar_pools"]["mamba"]
    assert m["zero_copy"] is True and m["parts"] == 4, m
    keys = keys_for(3)
    assert b.batch_set_v2([mamba_t(src, keys, [1, 3, 5])]) == {PoolName.MAMBA: [True] * 3}
    b2 = make("mp", dst, store_dir=store)
    before = states(dst)
    assert b2.batch_get_v2([mamba_t(dst, keys, [6, 0, 2])]) == {PoolName.MAMBA: [True] * 3}
    after = states(dst)
    for a, z in zip([1, 3, 5], [6, 0, 2]):
        assert torch.equal(after[z], page_bytes(src.mamba, a)), (a, z)
    for s in set(range(SLOTS)) - {6, 0, 2}:   # no other state was touched
        assert torch.equal(after[s], before[s]), s
    # a missing state is False, never an exception, and leaves its slot alone
    assert b2.batch_get_v2([mamba_t(dst, ["nope"], [7])]) == {PoolName.MAMBA: [False]}
    assert torch.equal(page_bytes(dst.mamba, 7), before[7])


def test_staged_and_zero_copy_states_read_each_other(make, tmp_path):  # noqa: F811
    store = str(tmp_path / "s")
    a, b_, c = MambaStack(1), MambaStack(2), MambaStack(3)
    staged = make("mp", a, store_dir=store, zero_copy=False)
    direct = make("mp", b_, store_dir=store)
    assert staged.metrics()["sidecar_pools"]["mamba"]["zero_copy"] is False
    assert direct.metrics()["sidecar_pools"]["mamba"]["zero_copy"] is True
    # written staged, read zero-copy
    k1 = keys_for(2, "staged")
    assert staged.batch_set_v2([mamba_t(a, k1, [2, 4])]) == {PoolName.MAMBA: [True, True]}
    assert direct.batch_get_v2([mamba_t(b_, k1, [5, 1])]) == {PoolName.MAMBA: [True, True]}
    assert torch.equal(page_bytes(b_.mamba, 5), page_bytes(a.mamba, 2))
    assert torch.equal(page_bytes(b_.mamba, 1), page_bytes(a.mamba, 4))
    # written zero-copy, read staged
    k2 = keys_for(2, "direct")
    want = [page_bytes(b_.mamba, 3), page_bytes(b_.mamba, 6)]
    assert direct.batch_set_v2([mamba_t(b_, k2, [3, 6])]) == {PoolName.MAMBA: [True, True]}
    staged_c = make("mp", c, store_dir=store, zero_copy=False)
    assert staged_c.batch_get_v2([mamba_t(c, k2, [0, 7])]) == {PoolName.MAMBA: [True, True]}
    assert torch.equal(page_bytes(c.mamba, 0), want[0])
    assert torch.equal(page_bytes(c.mamba, 7), want[1])
