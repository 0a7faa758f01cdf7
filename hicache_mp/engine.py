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
                              (hicache_mp.closing, then engine_build.release)

    with storage limits:      EvictorProcess (workers.evictor) keeps the store
                              under them; poll() pops its evict ring and the
                              index forgets those pages

Owns the public `mp` engine and the wiring of its parts, each a module of
one job: engine_build (resources, made at start and released at close),
striping (records, which worker gets which share), draining (rings into the
books), supervisor (health, watchdog, fences, respawns) and waiters (the
wake-up protocol, its numbered note); each is handed the ledger
(hicache_mp.ledger: ops, slot reservations, pins, counts), the lock and what
it serves, never the engine. EngineCore (hicache_mp.core) keeps input checks,
the index, waits, metrics. Must
not grow a job of its own here: a hook below only hands over to a part.

Direct I/O is decided once, at start (workers.directio.resolve): off, or the
store's filesystem accepts O_DIRECT and the geometry's page runs are 4096-byte
aligned; otherwise buffered, logged once.

The scheduler never blocks and never touches page bytes here. Every segment
and semaphore is named ``hicache_mp.<pid>.<random>.*`` and unlinked by
`close()`, by the finaliser on garbage collection or interpreter exit, by
orphaned workers when this process dies, and by `clean_stale()` at the next
start otherwise. Failure states: hicache_mp.supervisor.
"""
import os
import time
import weakref

from shm import PageGeometry
from workers import naming
from workers import status as st
from workers.control import BUSY_NS, BYTES, PAGES, STOP
from workers.timing import ABANDON_GRACE_S, HEALTH_CHECK_S, TARGET_CAP_S  # noqa: F401 (API)

from . import engine_build
from .cpubudget import ThrottleWatch
from .config import EngineConfig
from .core import EngineCore, check_timeout
from .discovery import PROBE_MAX
from .draining import Draining
from .engine_build import shm_bytes  # noqa: F401 (API: hicache_mp.engine.shm_bytes)
from .ops import Op
from .striping import Striping
from .supervisor import Supervisor
from .waiters import Waiters

# The completions of one op in one drain go through OpLedger.apply_many from
# this many up, else page by page (hicache_mp.draining; read at each drain, so
# a benchmark or test may set it here). Bulk has a fixed cost of ~90 µs per call on
# the 2-core CI box (some twenty numpy calls) against ~4.2 µs per page page by
# page; scripts/bench_poll.py measured both in one run: bulk wins from about 40
# pages of one op (1.2 against 4.2 µs per page at 128, 0.46 against 4.3 at 1024).
BATCH_APPLY_MIN = 64


class PrefetchEngine(EngineCore):
    backend = "mp"

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
        (hicache_mp.nodebudget).
        """
        super().__init__(config, geometry)
        self._segments, self._pool, self._evictor = [], None, None
        res = engine_build.build(config, geometry, self._store.roots, pool_fd=pool_fd,
                                 pool_parts=pool_parts, aux_workers=aux_workers)
        self.stale_removed = res.stale_removed
        self.tag = res.tag
        self.shared_pool = res.shared_pool
        self.direct_io, self.direct_io_reason = res.direct_io, res.direct_io_reason
        self.host_pool = res.host_pool
        self.done_sem = res.done_sem
        self._control = res.control
        self._ledger.share_pins(self._control.pins)  # the evictor reads the same table
        self._evictor = res.evictor
        self._pool = res.pool
        self._segments = res.segments
        self._striping = Striping(self._pool, self._control)
        # The parts hold the books (the ledger), the lock and what they serve,
        # never the engine; a question about the engine's state is a callable.
        self._draining = Draining(self._ledger, self._discovery, self._index, self._pool,
                                  self._control, self._evictor)
        self._supervisor = Supervisor(self._ledger, self._lock, config, self._pool,
                                      self._control, self._evictor, self._drain_ring,
                                      self._start_rescan)
        self._waiters = Waiters(self._lock, self._ledger, self._drain, lambda: self._closed,
                                lambda: self._released, self._control, self.done_sem)
        # The cgroup's throttle counters, read once a second from the drain
        # (hicache_mp.cpubudget); nothing at all where no quota binds.
        self.cpu_budget = res.cpu_budget
        self._throttle = ThrottleWatch(res.cpu_budget, len(self._pool))
        # Segments go even if the caller forgets close() or an exception unwinds.
        self._finalizer = weakref.finalize(self, engine_build.release, os.getpid(), self._pool,
                                           list(self._segments))

    # --- hooks: each hands over to one part -----------------------------------------
    def _check_accepting(self) -> None:
        self._pool.check()

    def _submit(self, op: Op) -> None:
        rejected = self._striping.submit(op)
        if rejected:
            now = time.perf_counter_ns()
            apply = self._ledger.apply
            for pos in rejected:  # backpressure: say so per page, never queue unbounded
                apply(op, pos, st.BUSY, 0, 0, now)

    def _probe(self, keys, whole: bool) -> set:
        """Hand probes for `keys` (the first is missing from the index; the
        others too with `whole`) to the workers; the digests still
        unanswered among them (hicache_mp.discovery)."""
        if self._pool is None or self._pool.closed or self._pool.broken:
            return set()
        if not self._pool.usable():
            return set()
        ns, disc, now = self.namespace, self._discovery, time.monotonic()
        asked = [naming.key_digest(keys[0], ns)]
        if whole:
            known = self._index.digests
            for key in keys[1:PROBE_MAX]:
                d = naming.key_digest(key, ns)
                if d not in known:
                    asked.append(d)
        # Within PROBE_TTL_S of the last asking a key is not asked again; if
        # that ask is still unanswered, the caller waits for it all the same.
        ask = [d for d in asked if disc.due(d, now)]
        if ask:
            disc.mark(self._striping.probe(ask), now)
        return disc.waiting.intersection(asked)

    def _drain(self, lazy: bool = False) -> int:
        if self._pool is None or self._pool.closed:
            return 0
        if lazy and not self._draining.due():
            n = 0
            self._lazy_skips += 1
            self._draining.evicted()
        else:
            n = self._draining.rings(BATCH_APPLY_MIN)
        self._supervisor.maybe_check()
        self._throttle.maybe_check()
        return n

    def _drain_ring(self, ring) -> int:
        return self._draining.ring(ring, BATCH_APPLY_MIN)

    def abandon(self, op: Op, grace_s: float = ABANDON_GRACE_S) -> None:
        """EngineCore.abandon: after `grace_s` for workers to skip the cancelled
        pages, a worker still holding one is stuck inside a page I/O that may yet
        write a slot. It is killed, and this returns once it is gone (the health
        check fails its pages and replaces it), so no slot is written afterwards."""
        grace_s = check_timeout(grace_s, "grace_s")
        self.cancel(op)
        if self.wait(op, grace_s):
            return
        self._supervisor.kill_holders(op, grace_s)
        self.wait(op)

    def _cancel_io(self, op: Op) -> None:
        self._control.cancel(op.id)

    def _sleep_for_completion(self, timeout_s: float, op=None) -> None:
        self._waiters.sleep(timeout_s, op)

    def _wake_sleepers(self) -> None:
        self._waiters.wake_all()

    def _shutdown_io(self) -> None:
        self._control.words[STOP] = 1  # the evictor watches it too
        if self._pool is not None:
            self._pool.stop()
            for handle in self._pool.workers:  # pages finished before the stop still count
                if not handle.rings_closed:
                    self._drain_ring(handle.completion_ring)
            self._pool.close()

    def _nudge_io(self) -> None:
        """One post per worker: records a signal handler's close() caught
        half-handed-out (pushed, not yet posted) are taken by the flush."""
        if self._pool is None or self._pool.closed:
            return
        for handle in self._pool.workers:
            if not handle.rings_closed:
                handle.wake.post()

    def _io_idle(self) -> bool:
        if self._pool is None or self._pool.closed:
            return True
        for handle in self._pool.workers:
            if not handle.rings_closed and (handle.read_ring.depth() or handle.write_ring.depth() or
                                            handle.completion_ring.pending()):
                return False
        return not self._control.heartbeat[:len(self._pool.workers)].any()

    def _forget_resources(self) -> None:
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()

    def _release_shm(self) -> None:
        # With the pool: normally closed already (_shutdown_io); not when a
        # close() from a signal handler interrupted that one while it stopped
        # the workers (hicache_mp.closing), whose rings then go here.
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        engine_build.release(os.getpid(), getattr(self, "_pool", None), self._segments)
        self._segments = []

    def _num_workers(self) -> int:
        return len(self._pool) if self._pool else 0

    def _worker_pids(self) -> list:
        return [h.pid for h in self._pool.workers] if self._pool else []

    def _io_metrics(self, now_ns: int) -> dict:
        wall = (now_ns - self._start_ns) / 1e9
        pool, ev = self._pool, self._evictor
        stats = self._control.workers[:len(pool)] if pool and not self._closed else []
        return {
            "worker_busy": [round(int(s[BUSY_NS]) / 1e9 / wall, 4) if wall else 0.0 for s in stats],
            "worker_pages": [int(s[PAGES]) for s in stats],
            **self._waiters.metrics(),
            "worker_bytes": [int(s[BYTES]) for s in stats],
            "ring_depth": [0 if h.rings_closed else h.read_ring.depth() + h.write_ring.depth()
                           for h in pool.workers] if pool else [],
            "write_ring_depth": [0 if h.rings_closed else h.write_ring.depth()
                                 for h in pool.workers] if pool else [],
            "respawns": pool.respawns if pool else 0,
            "workers_starting": len(pool.starting) if pool else 0,
            **self._supervisor.metrics(),
            "broken": pool.broken if pool else None,
            "direct_io": self.direct_io,
            "direct_io_reason": self.direct_io_reason,
            "io_depth": self.config.resolved_io_depth(self.direct_io),
            **self._ledger.budget_metrics(),
            "evictor_respawns": ev.respawns if ev else 0,
            "evicted_pages": ev.evicted_pages if ev else 0,
            "evicted_bytes": ev.evicted_bytes if ev else 0,
            "store_bytes_estimate": self._control.store_estimate()
            if ev and not self._closed else None,
            "stale_segments_removed": len(self.stale_removed),
            "probes_sent": self._discovery.sent,
            "probes_found": self._discovery.found,
            "shared_pool": self.shared_pool,
            # what the process may use and where that came from, and how often
            # its cgroup was throttled since start (decision 89)
            "cpu": {**self.cpu_budget.as_dict(), "throttle": self._throttle.metrics()},
        }
