"""poll(lazy=True) (decision 88): the pages of an op that cannot be done yet
stay in the rings, and every op still ends with its bytes exact, as vLLM's
tier, which reports whole jobs, relies on."""
import os
import signal
import time

import torch

from helpers import backed_up, engine, read_back


def _landed(eng) -> int:
    return sum(eng.metrics()["worker_pages"])


def test_a_lazy_poll_leaves_an_unfinished_op_alone_and_ends_it_exactly(store):
    n = 32
    with engine(store, pages=2 * n, workers=2) as eng:
        keys, data = backed_up(eng, n, seed=21)
        stopped = eng.worker_pids()[1]
        os.kill(stopped, signal.SIGSTOP)
        try:
            before = _landed(eng)
            op = eng.prefetch(keys, list(range(n, 2 * n)))
            deadline = time.monotonic() + 30
            while _landed(eng) - before < n // 4:  # the running worker's pages land
                assert time.monotonic() < deadline, "the running worker landed nothing"
                time.sleep(0.005)
            skipped = eng.metrics()["lazy_polls_skipped"]
            for _ in range(5):
                eng.poll(lazy=True)
            # its pages wait in the ring: the stopped worker's share is still out
            assert op.status_counts() == {"pending": n}
            assert eng.metrics()["lazy_polls_skipped"] == skipped + 5
        finally:
            os.kill(stopped, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not op.done:
            assert time.monotonic() < deadline, "the op did not end under lazy polls"
            eng.poll(lazy=True)
            time.sleep(0.001)
        assert op.status == "ok" and op.completed_pages == n
        assert torch.equal(read_back(eng, range(n, 2 * n)).view(torch.int16),
                           data.view(torch.int16))


def test_lazy_polls_end_many_small_ops_in_the_order_they_finish(store):
    """Ops of a page or two each (vLLM jobs of one row): each is drained once it
    may be done, whatever the ops still in flight beside it."""
    n = 48
    with engine(store, pages=2 * n, workers=2) as eng:
        keys, data = backed_up(eng, n, seed=22)
        ops = [eng.prefetch(keys[i:i + 2], [n + i, n + i + 1]) for i in range(0, n, 2)]
        deadline = time.monotonic() + 30
        while not all(op.done for op in ops):
            assert time.monotonic() < deadline, "ops did not end under lazy polls"
            eng.poll(lazy=True)
        assert [op.status for op in ops] == ["ok"] * len(ops)
        assert torch.equal(read_back(eng, range(n, 2 * n)).view(torch.int16),
                           data.view(torch.int16))
        assert eng.metrics()["ops_in_flight"] == 0
