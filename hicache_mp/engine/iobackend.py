"""The I/O backend protocol: what an engine's I/O side does for EngineCore.

Owns the seam between EngineCore (hicache_mp.engine.core: the calls, the books'
admission, close()'s order) and whatever moves page bytes: the `mp` worker
processes (hicache_mp.engine.prefetch.WorkerIO) or the in-process baselines' threads
(hicache_mp.bench: `file`, `fast_file`). An engine is an EngineCore over one
IOBackend; the backend is made by EngineCore's __init__ from an IOContext,
the narrow set of the engine's objects it may use. Must not hold the engine
itself: a question about its state (closed? released?) is a callable here.

Every call below is made by EngineCore with the engine's lock held, except
`sleep` (it takes the lock itself and gives it up while asleep),
`forget` (the at-fork hook, which takes no lock) and the read-only
`num_workers`, `pids`.
"""
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from shm import PageGeometry
from workers.store import PageStore

from .config import EngineConfig
from .discovery import Discovery
from .index import StoreIndex
from .ledger import OpLedger
from .ops import Op


@dataclass(frozen=True, eq=False)
class IOContext:
    """What a backend may use of its engine."""

    config: EngineConfig
    geometry: PageGeometry
    namespace: str
    store: PageStore                 # for paths and scans; workers open their own
    index: StoreIndex
    discovery: Discovery
    ledger: OpLedger                 # where completions go (its rules, under `lock`)
    lock: Any                        # the engine's RLock
    closed: Callable[[], bool]       # close() has begun stopping the I/O
    released: Callable[[], bool]     # shared memory is gone: touch nothing of it
    rescan: Callable[[], None]       # a rescan of the store, off the caller's thread
    start_ns: int                    # when the engine started (perf_counter_ns)


class IOBackend(Protocol):
    """An engine's I/O side."""

    name: str                        # metrics()["backend"]: "mp", "file", "fast_file"
    host_pool: Any                   # the host pool it reads into and writes from

    def check_accepting(self) -> None:
        """Raise if no more work is taken (before anything is reserved)."""

    def submit(self, op: Op) -> None:
        """Hand an admitted op's pending pages to the I/O; never wait. Pages
        refused (a full ring) end through the ledger at once."""

    def probe(self, keys, whole: bool) -> set:
        """Ask the store about `keys` (the first is missing from the index; the
        rest too with `whole`); the digests still unanswered (discovery)."""

    def drain(self, lazy: bool = False) -> int:
        """Completions into the ledger; the pages applied. `lazy`: decision 88."""

    def quiet(self) -> bool:
        """True only if a drain now would do nothing at all (nothing landed,
        no side work, no check due): poll()'s fast path, called without the
        engine's lock. False is always safe."""

    def cancel(self, op: Op) -> None:
        """Pages of `op` not yet started are skipped."""

    def sleep(self, timeout_s: float, op: Op | None = None) -> None:
        """Until `op`'s pages (or, with none, the next completion) may have
        landed, or `timeout_s`; the GIL and the lock released meanwhile."""

    def wake_all(self) -> None:
        """End every other thread's sleep (close())."""

    def nudge(self) -> None:
        """Wake the I/O once: work a signal handler's close() caught half
        handed out is taken by the flush."""

    def idle(self) -> bool:
        """Nothing waits in the I/O's queues and nothing is in a page I/O
        (False where that cannot be known)."""

    def rescan(self) -> None:
        """Scan the store for the index off the scheduler's process, after
        the scan running if any (only a backend whose engine was made with
        `background_scan`: the `mp` engine, decision 110)."""

    def shutdown(self) -> None:
        """Stop the I/O; what finished before the stop is drained."""

    def release(self) -> None:
        """Give the shared memory back (once, after shutdown)."""

    def forget(self) -> None:
        """In a forked child: drop every resource without touching it."""

    def num_workers(self) -> int: ...

    def pids(self) -> list: ...

    def metrics(self, now_ns: int) -> dict:
        """The I/O side's figures for metrics()."""
