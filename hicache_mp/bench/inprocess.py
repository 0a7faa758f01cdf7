"""The in-process baselines' threads: a read and a write thread in the scheduler's process.

Owns what `file` (hicache_mp.bench.baseline) and `fast_file`
(hicache_mp.bench.fast_file) share as EngineCore subclasses: the two queues
and threads, the completion deque, the event sleepers wait on, and stopping
it all. Must not do I/O: each
subclass's `_loop(kind)` does that, the way the backend it stands for does.
"""
import collections
import queue
import threading

from ..ops import READ, WRITE


class InProcessThreads:
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
        """What is put on `kind`'s queue, until `_shutdown_io`'s None."""
        return iter(self._queues[kind].get, None)

    def _sleep_for_completion(self, timeout_s: float, op=None) -> None:
        self._signal.wait(timeout_s)
        self._signal.clear()

    def _wake_sleepers(self) -> None:
        self._signal.set()

    def _stop_helpers(self) -> None:
        """After the threads are joined: anything else they used (thread pools)."""

    def _shutdown_io(self) -> None:
        self._stopping = True
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()
        self._stop_helpers()
        self._drain()

    def _release_shm(self) -> None:
        self.host_pool.close()
