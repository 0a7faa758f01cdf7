"""The in-process baselines' I/O backend base: a read and a write thread in the scheduler's process.

Owns what `file` (hicache_mp.bench.baseline) and `fast_file`
(hicache_mp.bench.fast_file) share as I/O backends (hicache_mp.engine.iobackend's
protocol, under a plain EngineCore): their host pool, the two queues and
threads, the completion deque, the event sleepers wait on, and stopping it
all. Must not do I/O: each subclass's `_loop(kind)` does that, the way the
backend it stands for does, and its `drain` feeds the ledger.
"""
import collections
import queue
import threading

from shm import HostPool, clean_stale, new_owner_tag

from ..engine.iobackend import IOContext
from ..engine.ops import READ, WRITE, Op


class InProcessThreads:
    def __init__(self, ctx: IOContext):
        self.geometry = ctx.geometry
        self._store = ctx.store        # page paths
        self._ledger = ctx.ledger      # where drain() applies completions, under the engine's lock
        clean_stale()
        self.tag = new_owner_tag()
        self.host_pool = HostPool(ctx.geometry, ctx.config.host_pool_pages,
                                  name=self.tag + ".pool", create=True,
                                  populate=ctx.config.populate)

    def _start_threads(self, label: str) -> None:
        self._done = collections.deque()
        self._signal = threading.Event()
        self._stopping = False
        self._queues = {READ: queue.Queue(), WRITE: queue.Queue()}
        self._threads = [threading.Thread(target=self._loop, args=(kind,), daemon=True,
                                          name=f"hicache_mp-{label}-{kind}")
                         for kind in (READ, WRITE)]
        for t in self._threads:
            t.start()

    def _queued(self, kind: str):
        """What is put on `kind`'s queue, until `shutdown`'s None."""
        return iter(self._queues[kind].get, None)

    def _stop_helpers(self) -> None:
        """After the threads are joined: anything else they used (thread pools)."""

    # --- the protocol (hicache_mp.engine.iobackend), as far as both baselines share it ---
    def check_accepting(self) -> None:
        pass

    def probe(self, keys, whole: bool) -> set:
        return set()  # no discovery: the index alone answers

    def cancel(self, op: Op) -> None:
        pass  # the threads check op.cancelled before each page or batch

    def sleep(self, timeout_s: float, op=None) -> None:
        self._signal.wait(timeout_s)
        self._signal.clear()

    def wake_all(self) -> None:
        self._signal.set()

    def nudge(self) -> None:
        pass

    def idle(self) -> bool:
        return False  # never known in-process

    def shutdown(self) -> None:
        self._stopping = True
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()
        self._stop_helpers()
        self.drain()

    def release(self) -> None:
        self.host_pool.close()

    def forget(self) -> None:
        pass

    def pids(self) -> list:
        return []

    def num_workers(self) -> int:
        return 1

    def metrics(self, now_ns: int) -> dict:
        return {}
