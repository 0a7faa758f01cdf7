"""A waiter that competes for the GIL with a pure-Python scheduler thread is
woken a little before its op ends (hicache_mp.gillead), and still returns
only once every page has landed, with the right bytes."""
import os
import threading

import torch

from helpers import engine, fill, random_pages, read_back


def _busy(stop):
    x = 1
    while not stop.is_set():   # pure Python: never gives the GIL up by itself
        for i in range(2000):
            x = (x * 1103515245 + i) & 0xFFFFFFFF


def test_an_early_wake_under_a_busy_scheduler_returns_whole_ops_with_their_bytes(store):
    n = 64
    keys = [os.urandom(32).hex() for _ in range(n)]
    with engine(store, pages=n, workers=2) as eng:
        data = random_pages(eng.geometry, n, seed=11)
        fill(eng, range(n), data)
        op = eng.backup(keys, list(range(n)))
        assert eng.wait(op, 60) and op.status == "ok"
        stop = threading.Event()
        busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
        busy.start()
        try:
            for _ in range(12):
                eng.host_pool.tensor.fill_(7)
                op = eng.prefetch(keys, list(range(n)))
                assert eng.wait(op, 60)
                # wait() returned: the op is whole, never a page short
                assert op.done and op.status == "ok" and op.completed_pages == n, op
                assert torch.equal(read_back(eng, range(n)).view(torch.int16),
                                   data.view(torch.int16))
        finally:
            stop.set()
            busy.join()
        m = eng.metrics()
    # The busy thread held the GIL: taking it back after a post took more
    # than a wake-up's latency, so later waits asked to be woken early.
    assert m["wait_gil_delay_ms"] > 0.5, m
    assert m["wait_early_wakes"] + m["wait_early_spun_out"] > 0, m
