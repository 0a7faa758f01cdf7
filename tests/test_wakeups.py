"""A thread blocked in wait() on one batch is woken about once, when the
batch is done, not once per page: each wake-up takes the GIL back from the
scheduler (control: WAKE_AT)."""
import os

import torch

from helpers import engine, fill, random_pages, read_back


def _wakeups(eng):
    m = eng.metrics()
    return m["wait_wakeups_posted"], m["wait_wakeups_timeout"]


def test_one_waiter_is_woken_once_per_batch_not_per_page(store):
    n = 256
    keys = [os.urandom(32).hex() for _ in range(n)]
    with engine(store, pages=n, workers=2) as eng:
        data = random_pages(eng.geometry, n, seed=3)
        fill(eng, range(n), data)
        op = eng.backup(keys, list(range(n)))
        assert eng.wait(op, 60) and op.status == "ok"
        posted0, _ = _wakeups(eng)
        assert posted0 <= 4, f"{posted0} posted wake-ups for one {n}-page batch"
        for _ in range(3):
            eng.host_pool.tensor.fill_(7)
            before = _wakeups(eng)[0]
            op = eng.prefetch(keys, list(range(n)))
            assert eng.wait(op, 60) and op.status == "ok" and op.completed_pages == n
            assert _wakeups(eng)[0] - before <= 4
            assert torch.equal(read_back(eng, range(n)).view(torch.int16), data.view(torch.int16))
