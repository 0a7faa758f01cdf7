"""PrefetchEngine: the `mp` backend. The scheduler's side of the worker pool.

    caller (scheduler loop)           PrefetchEngine                      WorkerPool
    -----------------------           --------------                      ----------
    prefetch(keys, slots) ──► check input, reserve slots (EngineCore),
                              one 64-byte record per page, striped over
                              workers (striping) ────────────────────────► read_ring[i]
                              post wake[i] once per batch                   (worker i reads the
    poll() every loop     ──► pop completion rings (draining), advance      file straight into
                              ops, free slots ◄─────────────────────────── the pool slot)
                              health check (supervisor)
    wait(op)              ──► sleep until the batch is surely done (waiters)
    op.completed_pages        leading pages landed, in order
    backup(keys, slots)   ──► same road, on each worker's write ring (served
                              after its read ring); pages over the backup
                              budget end DROPPED at once; workers write
                              temp + rename (O_DIRECT when the store allows)
    close()               ──► pool shutdown protocol, unlink every segment
                              (hicache_mp.engine.closing, then resources.release)

    with storage limits:      EvictorProcess (workers.evictor) keeps the store
                              under them; poll() pops its evict ring and the
                              index forgets those pages
    at start (and rescans):   a scanner process (workers.scanner) lists the
                              store; poll() takes a share of its ring into
                              the index (storescan)

Owns the public `mp` engine and its I/O backend, `WorkerIO`
(hicache_mp.engine.iobackend's protocol): the wiring of its parts, each a module of
one job: resources (made at start and released at close), storescan
(the store's scans, walked by a scanner process), striping (records,
which worker gets which share), draining (rings into the books), supervisor (health, watchdog, fences, respawns) and waiters (the
wake-up protocol, its numbered note); each is handed the ledger
(hicache_mp.engine.ledger: ops, slot reservations, pins, counts), the lock and what
it serves, never the engine. EngineCore (hicache_mp.engine.core) keeps input checks,
the index, waits, metrics, and calls WorkerIO through the protocol. Must
not grow a job of its own here: each WorkerIO call only hands over to a part.

Direct I/O is decided once, at start (workers.directio.resolve): off, or the
store's filesystem accepts O_DIRECT and the geometry's page runs are 4096-byte
aligned; otherwise buffered, logged once.

The scheduler never blocks and never touches page bytes here. Every segment
and semaphore is named ``hicache_mp.<pid>.<random>.*`` and unlinked by
`close()`, by the finaliser on garbage collection or interpreter exit, by
orphaned workers when this process dies, and by `clean_stale()` at the next
start otherwise. Failure states: hicache_mp.engine.supervisor.
"""
import os
import time
import weakref

from shm import PageGeometry
from workers import status as st
from workers.control import BUSY_NS, BYTES, EVICT_PASSES, PAGES, STOP
from workers.timing import ABANDON_GRACE_S, HEALTH_CHECK_S, TARGET_CAP_S  # noqa: F401 (API)

from . import resources
from .cpubudget import ThrottleWatch
from .config import EngineConfig
from .core import EngineCore, check_timeout
from .draining import Draining
from .iobackend import IOContext
from .ops import Op
from .resources import shm_bytes  # noqa: F401 (API: hicache_mp.engine.shm_bytes)
from .storescan import StoreScan
from .striping import Striping
from .supervisor import Supervisor
from .waiters import Waiters

# The completions of one op in one drain go through OpLedger.apply_many from
# this many up, else page by page (OpLedger.settle; read at each drain, so
# a benchmark or test may set it here). Bulk has a fixed cost of ~90 µs per call on
# the 2-core CI box (some twenty numpy calls) against ~4.2 µs per page page by
# page; scripts/bench_poll.py measured both in one run: bulk wins from about 40
# pages of one op (1.2 against 4.2 µs per page at 128, 0.46 against 4.3 at 1024).
BATCH_APPLY_MIN = 64


class PrefetchEngine(EngineCore):
    """The `mp` engine: an EngineCore over WorkerIO."""

    def __init__(self, config: EngineConfig, geometry: PageGeometry, *, pool_fd: int | None = None,
                 pool_parts=None, aux_workers: int | None = None):
        """`pool_fd`: map this region as the host pool instead of creating one.

        For pools that someone else owns, e.g. SGLang's memfd host pool
        (hicache_mp.integrations.sglang): the engine keeps its own dup of the
        descriptor, hands it to every worker (Popen pass_fds), never unlinks or
        resizes it, and closes the dup on close(). The region must hold at least
        `geometry.pool_bytes(config.host_pool_pages)` bytes from offset 0.

        `pool_parts`: instead, a pool whose page is one run in each of several
        regions: (fd, offset, stride) per part, page p being the runs
        [offset + p * stride, stride) in part order (shm.partpool; SGLang's
        Mamba state, one memfd per tensor). Same ownership rules as pool_fd;
        the strides must add up to the geometry's page bytes. Such a pool has
        no `tensor` view: its pages are only moved by the workers.

        `aux_workers`: this engine is an auxiliary of another in this process
        (a hybrid model's sidecar pool): with auto workers it takes at most
        this many from the node's budget and counts as no scheduler there
        (hicache_mp.engine.nodebudget).
        """
        super().__init__(config, geometry, lambda ctx: WorkerIO(
            ctx, self, pool_fd=pool_fd, pool_parts=pool_parts, aux_workers=aux_workers),
            background_scan=True)
        io, res = self._io, self._io.built
        self.stale_removed, self.tag, self.shared_pool = res.stale_removed, res.tag, res.shared_pool
        self.direct_io, self.direct_io_reason = res.direct_io, res.direct_io_reason
        self.done_sem = res.done_sem
        self.cpu_budget = res.cpu_budget
        # The same objects under the names tests and tools inspect the workers by.
        self._pool, self._control, self._evictor = io.pool, io.control, io.evictor
        self._waiters = io.waiters

    def abandon(self, op: Op, grace_s: float = ABANDON_GRACE_S) -> None:
        """EngineCore.abandon: after `grace_s` for workers to skip the cancelled
        pages, a worker still holding one is stuck inside a page I/O that may yet
        write a slot. It is killed, and this returns once it is gone (the health
        check fails its pages and replaces it), so no slot is written afterwards."""
        grace_s = check_timeout(grace_s, "grace_s")
        self.cancel(op)
        if self.wait(op, grace_s):
            return
        self._io.supervisor.kill_holders(op, grace_s)
        self.wait(op)


class WorkerIO:
    """The `mp` engine's I/O backend (hicache_mp.engine.iobackend): what
    `resources` makes, and the parts that use them. `owner`: the engine, for
    the finaliser alone (segments go when it is collected)."""

    name = "mp"

    def __init__(self, ctx: IOContext, owner, *, pool_fd, pool_parts, aux_workers):
        config = ctx.config
        self.config, self.namespace, self.start_ns = config, ctx.namespace, ctx.start_ns
        self.discovery, self.index, self.ledger = ctx.discovery, ctx.index, ctx.ledger
        self.closed = ctx.closed
        self.lazy_skips = 0  # lazy polls that drained nothing (decision 88)
        res = self.built = resources.build(config, ctx.geometry, ctx.store.roots,
                                           pool_fd=pool_fd, pool_parts=pool_parts,
                                           aux_workers=aux_workers)
        self.host_pool = res.host_pool
        self.control = res.control
        ctx.ledger.share_pins(self.control.pins)  # the evictor reads the same table
        self.evictor = res.evictor
        self.pool = res.pool
        self.segments = res.segments
        self.striping = Striping(self.pool, self.control)
        # The parts hold the books (the ledger), the lock and what they serve,
        # never the engine; a question about the engine's state is a callable.
        self.store_scan = StoreScan(res.scanner, ctx.index)
        self.draining = Draining(ctx.ledger, ctx.discovery, ctx.index, self.pool,
                                 self.control, self.evictor, self.store_scan)
        self.supervisor = Supervisor(ctx.ledger, ctx.lock, config, self.pool, self.control,
                                     self.evictor, self.drain_ring, ctx.rescan)
        self.waiters = Waiters(ctx.lock, ctx.ledger, self.drain, ctx.closed, ctx.released,
                               self.control, res.done_sem)
        # The cgroup's throttle counters, read at most every 5 s from the
        # drain's health-check tick, with the workers' CPU time to tell whose
        # work throttled it (hicache_mp.engine.cpubudget); nothing at all where
        # no quota binds.
        self.throttle = ThrottleWatch(res.cpu_budget, len(self.pool), pids=self.pids,
                                      auto=not config.num_workers)
        # Segments go even if the caller forgets close() or an exception unwinds.
        self.finalizer = weakref.finalize(owner, resources.release, os.getpid(), self.pool,
                                          list(self.segments))
        # Last, once the workers are ready: the scan's walk is off this
        # process, so the constructor returns whatever the store holds, and
        # the scanner's start does not compete with the workers' (decision 110).
        self.store_scan.start(ctx.store)
        if self.evictor is not None:
            self.evictor.wake.post()  # its first pass, held until now (workers.evictor)

    # --- the protocol: each call hands over to one part ------------------------------
    def check_accepting(self) -> None:
        self.pool.check()

    def submit(self, op: Op) -> None:
        rejected = self.striping.submit(op)
        if rejected:
            now = time.perf_counter_ns()
            apply = self.ledger.apply
            for pos in rejected:  # backpressure: say so per page, never queue unbounded
                apply(op, pos, st.BUSY, 0, 0, now)

    def probe(self, keys, whole: bool) -> set:
        """Hand probes for `keys` (the first is missing from the index; the
        others too with `whole`) to the workers; the digests still
        unanswered among them (hicache_mp.engine.discovery)."""
        if self.pool.closed or self.pool.broken:
            return set()
        if not self.pool.usable():
            return set()
        return self.discovery.ask(keys, whole, self.namespace, self.index.digests,
                                  self.striping.probe)

    def quiet(self) -> bool:
        # the busy loop's every poll (issue 45): plain reads and one call
        return not self.pool.closed and time.monotonic() < self.supervisor.due_at and \
            self.draining.quiet()

    def drain(self, lazy: bool = False) -> int:
        if self.pool.closed:
            return 0
        if lazy and not self.draining.due():
            n = 0
            self.lazy_skips += 1
            self.draining.side_rings()
        else:
            n = self.draining.rings(BATCH_APPLY_MIN)
        if self.supervisor.maybe_check():
            # At the health check's pace, not every poll: a poll with nothing
            # to do costs what it did before the watch (one clock read).
            self.throttle.maybe_check()
        return n

    def rescan(self) -> None:
        self.store_scan.rescan()

    def drain_ring(self, ring) -> int:
        return self.draining.ring(ring, BATCH_APPLY_MIN)

    def cancel(self, op: Op) -> None:
        self.control.cancel(op.id)

    def sleep(self, timeout_s: float, op=None) -> None:
        self.waiters.sleep(timeout_s, op)

    def wake_all(self) -> None:
        self.waiters.wake_all()

    def shutdown(self) -> None:
        self.control.words[STOP] = 1  # the evictor watches it too
        self.pool.stop()
        for handle in self.pool.workers:  # pages finished before the stop still count
            if not handle.rings_closed:
                self.drain_ring(handle.completion_ring)
        self.pool.close()

    def nudge(self) -> None:
        """One post per worker: records a signal handler's close() caught
        half-handed-out (pushed, not yet posted) are taken by the flush."""
        if self.pool.closed:
            return
        for handle in self.pool.workers:
            if not handle.rings_closed:
                handle.wake.post()

    def idle(self) -> bool:
        if self.pool.closed:
            return True
        for handle in self.pool.workers:
            if not handle.rings_closed and (handle.read_ring.depth() or handle.write_ring.depth() or
                                            handle.completion_ring.pending()):
                return False
        return not self.control.heartbeat[:len(self.pool.workers)].any()

    def forget(self) -> None:
        self.finalizer.detach()

    def release(self) -> None:
        # With the pool: normally closed already (shutdown); not when a
        # close() from a signal handler interrupted that one while it stopped
        # the workers (hicache_mp.engine.closing), whose rings then go here.
        self.finalizer.detach()
        resources.release(os.getpid(), self.pool, self.segments)
        self.segments = []

    def num_workers(self) -> int:
        return len(self.pool)

    def pids(self) -> list:
        return [h.pid for h in self.pool.workers]

    def metrics(self, now_ns: int) -> dict:
        wall = (now_ns - self.start_ns) / 1e9
        pool, ev, closed, res = self.pool, self.evictor, self.closed(), self.built
        stats = self.control.workers[:len(pool)] if not closed else []
        return {
            "lazy_polls_skipped": self.lazy_skips,
            "worker_busy": [round(int(s[BUSY_NS]) / 1e9 / wall, 4) if wall else 0.0 for s in stats],
            "worker_pages": [int(s[PAGES]) for s in stats],
            **self.waiters.metrics(),
            "worker_bytes": [int(s[BYTES]) for s in stats],
            "ring_depth": [0 if h.rings_closed else h.read_ring.depth() + h.write_ring.depth()
                           for h in pool.workers],
            "write_ring_depth": [0 if h.rings_closed else h.write_ring.depth()
                                 for h in pool.workers],
            "respawns": pool.respawns,
            "workers_starting": len(pool.starting),
            **self.supervisor.metrics(),
            "broken": pool.broken,
            "direct_io": res.direct_io,
            "direct_io_reason": res.direct_io_reason,
            "io_depth": self.config.resolved_io_depth(res.direct_io),
            **self.ledger.budget_metrics(),
            "evictor_respawns": ev.respawns if ev else 0,
            "evicted_pages": ev.evicted_pages if ev else 0,
            "evicted_bytes": ev.evicted_bytes if ev else 0,
            "store_bytes_estimate": self.control.store_estimate()
            if ev and not closed else None,
            # the evictor has measured the whole store once (its first pass)
            "store_capacity": None if not ev or closed else
            "counted" if int(self.control.words[EVICT_PASSES]) else "counting",
            "stale_segments_removed": len(res.stale_removed),
            "probes_sent": self.discovery.sent,
            "probes_found": self.discovery.found,
            "shared_pool": res.shared_pool,
            # what the process may use and where that came from, and how often
            # its cgroup was throttled since start (decision 89)
            "cpu": {**res.cpu_budget.as_dict(), "throttle": self.throttle.metrics()},
        }
