"""InstantStore: the `none` backend, where every cached page already sits in host memory.

Owns the ideal: `exists` answers from the set of warmed keys and `prefetch`
returns an op that is already done, so a run on it measures the scheduler and
the compute model alone. Must not do any I/O or allocate a host pool; it has
no backup path (nothing is written, as nothing needs to be).
"""
from __future__ import annotations

import time


class InstantOp:
    kind = "read"
    status = "ok"
    done = True
    io_ns = 0
    worker_of = None

    def __init__(self, pages: int, page_bytes: int):
        self.num_pages = pages
        self.completed_pages = pages
        self.ok_pages = pages
        self.page_bytes = page_bytes
        self.submit_ns = self.first_ns = self.done_ns = time.perf_counter_ns()
        self.landed_ns = [self.done_ns] * pages
        self.seconds = 0.0
        self.gbps = None  # no transfer happened: a rate would be meaningless

    def ready(self, now_ns=None) -> bool:
        return True


class InstantStore:
    backend = "none"
    host_pool = None

    def __init__(self, keys, page_bytes: int):
        self._keys = set(keys)
        self.page_bytes = page_bytes
        self._poll_calls = 0

    def exists(self, keys) -> int:
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def prefetch(self, keys, host_pages, *, policy=None, timeout_s=None) -> InstantOp:
        # No bytes move, so the op reports none (its pages still count as hits).
        return InstantOp(len(host_pages), 0)

    def poll(self) -> int:
        self._poll_calls += 1
        return 0

    def cancel(self, op) -> None:
        pass

    def metrics(self) -> dict:
        return {"backend": "none", "workers": 0, "poll_calls": self._poll_calls,
                "read_bytes": 0, "write_bytes": 0, "read_gbps": 0.0, "write_gbps": 0.0,
                "worker_busy": []}

    def close(self) -> None:
        pass
