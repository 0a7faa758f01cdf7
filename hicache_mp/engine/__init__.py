"""The `mp` engine: the scheduler's side of the worker pool, one module a job.

    prefetch    PrefetchEngine, an EngineCore over WorkerIO (the worker processes' I/O)
    core        EngineCore: namespace, lock, starting ops, cancel, poll, wait, metrics
    iobackend   the I/O backend protocol and IOContext (decision 94)
    ledger      OpLedger: the books, ops in flight, slots, pins, counts (decision 92)
    ops         Op: one prefetch or backup, as its caller sees it
    index       StoreIndex: the pages known to be in the store
    discovery   which missed keys are asked of the store, which answers are awaited
    lookups     IndexLookups: exists, present, awaiting_discovery over the index
    checks      input checks
    closing     close(), EngineClosed, EngineForked
    ownership   the at-fork hook: the engine is its maker process's
    resources   what an engine makes at start and releases at close
    striping    records, each worker's share, one post per share
    draining    the rings popped as one drain per poll
    supervisor  health, watchdog, fences, respawns
    waiters     the wake-up protocol and its numbered note
    config      EngineConfig: each setting declared once
    cpubudget   the CPU the process may keep busy, the throttle watch (decision 89)
    nodebudget  the worker budget that engines with auto workers share

Imports point down only, to `workers` and `shm`: nothing here imports the
DeviceLoader (hicache_mp.device), the adapters (hicache_mp.integrations),
the bench or torch; they build on this package.
"""
from .closing import EngineClosed, EngineForked
from .config import EngineConfig
from .ops import Op
from .prefetch import PrefetchEngine
from .resources import shm_bytes

__all__ = ["PrefetchEngine", "EngineConfig", "Op", "EngineClosed", "EngineForked", "shm_bytes"]
