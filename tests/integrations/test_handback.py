"""The opt-in GIL hand-back (`gil_handback_us`): the switch interval is lowered
exactly while a batch waits, and always restored, through the real adapter."""
import os
import signal
import sys
import threading

import pytest
import torch

from hicache_mp.integrations.handback import HandbackScope
from test_sglang import attach, fill_random  # noqa: F401 (attach is a fixture)


def test_scope_lowers_while_anyone_waits_and_restores_what_it_found():
    old = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        scope = HandbackScope(0.0002)
        with scope:
            assert sys.getswitchinterval() == pytest.approx(0.0002, rel=0.01)
            with scope:  # a second waiter shares it
                pass
            assert sys.getswitchinterval() == pytest.approx(0.0002, rel=0.01)
        assert sys.getswitchinterval() == pytest.approx(0.004, rel=0.01)
        with pytest.raises(RuntimeError):
            with scope:
                raise RuntimeError("a failed wait still restores")
        assert sys.getswitchinterval() == pytest.approx(0.004, rel=0.01)
        with HandbackScope(0.0):  # off: untouched
            assert sys.getswitchinterval() == pytest.approx(0.004, rel=0.01)
    finally:
        sys.setswitchinterval(old)


def test_adapter_lowers_the_interval_only_during_its_batches(attach):  # noqa: F811
    old = sys.getswitchinterval()
    backend, pool = attach(layout="layer_first", allocator="shm", pages=16, gil_handback_us=150)
    keys = [f"h{i}" for i in range(8)]
    want = fill_random(pool, range(8), seed=3)
    assert backend.batch_set_v1(keys, pool.token_indices(range(8))) == [True] * 8
    seen, stop = set(), threading.Event()

    def sample():  # what the interval is while batches run on the main thread
        while not stop.is_set():
            seen.add(round(sys.getswitchinterval(), 6))

    t = threading.Thread(target=sample)
    t.start()
    pids = backend.engine.worker_pids()
    try:
        for _ in range(3):
            pool.kv_buffer.zero_()
            # the workers held for a moment: the batch surely blocks in its wait
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            threading.Timer(0.05, lambda: [os.kill(p, signal.SIGCONT) for p in pids]).start()
            assert backend.batch_get_v1(keys, pool.token_indices(range(8, 16))) == [True] * 8
    finally:
        stop.set()
        t.join()
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert 0.00015 in seen, seen                      # lowered while a batch waited
    assert sys.getswitchinterval() == old             # and given back afterwards
    for i in range(8):
        assert torch.equal(pool.get_data_page((8 + i) * pool.page_size), want[i])


@pytest.mark.parametrize("bad", [-1, 6000, "fast"])
def test_a_bad_handback_value_is_refused_before_any_worker_starts(bad):
    from hicache_mp.integrations.sglang import HiCacheMP

    class Cfg:
        extra_config = {"gil_handback_us": bad}
        tp_rank, tp_size, is_mla_model, model_name = 0, 1, False, "m"

    with pytest.raises(ValueError, match="gil_handback_us"):
        HiCacheMP(Cfg())
