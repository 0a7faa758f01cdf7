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


def test_pages_the_engine_settles_itself_do_not_push_the_target_out_of_reach(store):
    """Backups dropped over the budget are settled by the engine, never by a
    worker: a wake-up target counted from every completion would then sit above
    what the workers can ever count, and every later wait would sleep to its cap
    instead of being woken when its batch is done."""
    import signal
    import threading
    n = 64
    keys = [os.urandom(32).hex() for _ in range(n)]
    with engine(store, pages=2 * n, workers=2, backup_budget_pages=8) as eng:
        data = random_pages(eng.geometry, n, seed=5)
        fill(eng, range(n), data)
        for i in range(0, n, 8):   # one batch at a time fits the budget
            op = eng.backup(keys[i:i + 8], list(range(i, i + 8)))
            assert eng.wait(op, 60) and op.status == "ok"
        pids = eng.worker_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            dropped = eng.backup([os.urandom(32).hex() for _ in range(40)],
                                 list(range(n, n + 40)))
            eng.poll()
            assert dropped.status_counts().get("dropped", 0) >= 32   # settled engine-side
            eng.host_pool.tensor[:n].fill_(7)
            op = eng.prefetch(keys, list(range(n)))
        finally:
            # the waiter below is asleep (with its target) before the workers go on
            threading.Timer(0.3, lambda: [os.kill(p, signal.SIGCONT) for p in pids]).start()
        _, expired0 = _wakeups(eng)
        assert eng.wait(op, 60) and op.status == "ok"
        _, expired = _wakeups(eng)
        assert eng.wait(dropped, 60)
        assert expired - expired0 <= 1, f"{expired - expired0} sleeps ran to their cap"
        assert torch.equal(read_back(eng, range(n)).view(torch.int16), data.view(torch.int16))
