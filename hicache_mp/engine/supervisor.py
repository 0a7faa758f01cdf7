"""Supervision: watching the engine's worker and evictor processes from poll().

Owns the health check (every HEALTH_CHECK_S, from a drain, never blocking
it), failing a lost worker's pages, the watchdog for stuck workers, the
fences on a killed worker's host slots, replacements (through
workers.pool.WorkerPool.respawn), killing what an abandoned op still holds,
and the counters of all this. Must not start or reap processes itself (the
pool does, one waitpid or load each), nor move a worker's state (the pool's
calls do: workers.handle), nor pop rings other than to take what a lost
worker finished first (through the engine's drain), nor touch the books but
through the ledger's rules (fail a worker's pages, fence its slots). It
holds the ledger and the engine's lock, never the engine.

Failure states:
  - a worker dies: its unfinished pages end WORKER_DIED (ops end partial or
    failed); a replacement starts in the background and takes work once
    ready, meanwhile new pages go to the other workers;
  - a worker is stuck (one page I/O older than `stall_timeout_s`, from the
    per-lane heartbeat in the control block, or records waiting that long in
    its rings untaken): it is SIGKILLed, every page it still holds ends
    WORKER_DIED at once (counted in `stalled_pages`), and it is replaced as
    above. Its pages' host slots stay reserved (fenced), and their ops not
    done, until the killed process is reaped: a page reported failed is never
    written into its slot later, whatever the kernel finishes meanwhile, and a
    caller that reuses an op's slots at op.done cannot meet the fence;
  - a replacement cannot be started: the pool is broken (`BrokenPool`, one
    terminal state in workers.pool), and every later prefetch or backup
    says so; a healthy engine never does.
The states a worker goes through on these paths, and the moves allowed
between them: workers.handle.
"""
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from shm import Ring
from workers import status as st
from workers.control import Control
from workers.evictor import EvictorProcess
from workers.handle import WorkerState
from workers.pool import BrokenPool, WorkerPool
from workers.timing import HEALTH_CHECK_S

from .config import EngineConfig
from .ledger import OpLedger

log = logging.getLogger("hicache_mp")


@dataclass(eq=False, repr=False)
class Supervisor:
    """Watches `pool` and `evictor` for an engine: a lost worker's pages are
    settled in `ledger` (hicache_mp.engine.ledger) under `lock`, the engine's;
    `drain_ring` applies what a worker finished before it was lost, and
    `rescan` starts a rescan of the store off this thread."""

    ledger: OpLedger
    lock: Any                      # the engine's RLock
    config: EngineConfig
    pool: WorkerPool
    control: Control
    evictor: EvictorProcess | None  # None: no storage limits
    drain_ring: Callable[[Ring], object]
    rescan: Callable[[], None]
    stuck_workers: int = field(default=0, init=False)
    stalled_pages: int = field(default=0, init=False)
    _evictor_failed: Any = field(default=None, init=False)  # its Child that did not start
    # When the next health check is due (monotonic): the engine's quiet poll
    # reads it as one compare (issue 45).
    due_at: float = field(default_factory=lambda: time.monotonic() + HEALTH_CHECK_S, init=False)
    # the watchdog's gap rule
    _watched_at: float = field(default_factory=time.monotonic, init=False)
    _watch_from_ns: int = field(default=0, init=False)

    def due(self) -> bool:
        """Whether the next maybe_check() would run the health check."""
        return time.monotonic() > self.due_at

    def maybe_check(self) -> bool:
        """The health check, when HEALTH_CHECK_S has passed since the last:
        whether it ran (the drain's other periodic work rides on it)."""
        now = time.monotonic()
        if now > self.due_at:
            self.due_at = now + HEALTH_CHECK_S
            self.health()
            return True
        return False

    def health(self) -> None:
        """Watch the children: none of this waits for a process."""
        self._replace_dead()
        ready, failed = self.pool.poll_starting()
        for handle in ready:
            log.info("hicache_mp-worker-%d (pid %d) is ready", handle.index, handle.pid)
        for handle in failed:
            n = len(self.fail_pages(handle.index))
            log.warning("hicache_mp-worker-%d's replacement did not start (%s); %d page(s) "
                        "failed; trying again", handle.index, handle.start_error, n)
            self._respawn(handle)
        # Fences lift before the watchdog looks: a worker killed in this pass is
        # never reaped in it, so its slots stay fenced at least until the next.
        for handle in self.pool.reaped():
            self.ledger.unfence(handle, time.perf_counter_ns())
            if handle.state is WorkerState.REAPED:  # its replacement waited for this
                self._respawn(handle)
        self._watchdog()

    def fail_pages(self, index: int, fence=None) -> np.ndarray:
        """End every page still pending at worker `index` WORKER_DIED. `fence`:
        the killed handle, when that worker may still write their host slots
        (the ledger holds them, and their ops, until it is reaped). Returns the
        slots."""
        return self.ledger.fail_worker(index, time.perf_counter_ns(), fence=fence)

    def _replace_dead(self) -> None:
        ev = self.evictor
        if ev is not None and not self.pool.closed:
            if ev.child is not None and ev.child is not self._evictor_failed:
                try:
                    ev.check_start()
                except RuntimeError as exc:
                    log.error("hicache_mp-evictor: %s; storage limits are enforced by "
                              "dropping writes only from now on", exc)
                    self._evictor_failed = ev.child
            if not ev.alive() and ev.child is not self._evictor_failed:
                log.warning("hicache_mp-evictor died with exit code %s; starting a replacement",
                            ev.proc.returncode if ev.proc else None)
                ev.respawns += 1
                ev.start(self.config.worker_start_timeout_s, wait=False)
        for handle in self.pool.dead():
            if not handle.rings_closed:
                self.drain_ring(handle.completion_ring)  # what it finished before dying still counts
            failed = len(self.fail_pages(handle.index))
            log.warning("hicache_mp-worker-%d (pid %d) died with exit code %s; %d in-flight "
                        "page(s) failed; starting a replacement", handle.index, handle.pid,
                        handle.child.returncode, failed)
            # A worker killed mid-write leaves its temp file behind (never a page: it
            # does not end in .page). A rescan, off this thread, reaps temp files of
            # dead writers now rather than at the next start, and indexes pages it
            # renamed into place just before dying.
            self.rescan()
            self._respawn(handle)

    def _watchdog(self) -> None:
        """A worker is stuck (module docstring) when one page I/O has run longer
        than stall_timeout_s, or when records have waited in its rings that long
        without it taking one (stuck outside a page I/O: stopped, or wedged)."""
        limit = self.config.stall_timeout_s
        now = time.monotonic()
        # After a gap in the looks (this process paused with its workers, or not
        # polled) an I/O's age counts from now, as the rings' count restarts: a
        # worker stopped with it is no more stuck than the engine was.
        if now - self._watched_at > limit / 4:
            self._watch_from_ns = time.monotonic_ns()
        self._watched_at = now
        stalled = self.control.stalled(len(self.pool.workers), limit,
                                       since_ns=self._watch_from_ns)
        for handle in self.pool.usable():
            idle = handle.idle_with_work_s(now, limit / 4)
            if idle > limit:
                stalled[handle.index] = max(stalled[handle.index], idle)
        if not stalled.any():
            return
        for index in np.flatnonzero(stalled).tolist():
            handle = self.pool.workers[index]
            if handle.state is not WorkerState.READY or not handle.alive():
                continue
            age_s = float(stalled[index])
            self.pool.kill_stuck(handle)
            self.drain_ring(handle.completion_ring)  # pages it did finish are good
            slots = self.fail_pages(index, fence=handle)
            self.stuck_workers += 1
            self.stalled_pages += len(slots)
            log.error("hicache_mp-worker-%d (pid %d) is stuck: no progress for %.1fs, over "
                      "stall_timeout_s=%ss; killed, %d page(s) failed (their host slots stay "
                      "reserved, and their ops not done, until it is gone); starting a replacement", index, handle.pid,
                      age_s, self.config.stall_timeout_s, len(slots))
            self._respawn(handle)

    def _respawn(self, handle) -> None:
        try:
            self.pool.respawn(handle)
        except BrokenPool as exc:
            log.error("hicache_mp: %s; the engine takes no more work", exc)

    def kill_holders(self, op, grace_s: float) -> None:
        """SIGKILL every worker still holding a page of `op` (abandoned, and
        not done within `grace_s`): the health check fails its pages and
        replaces it."""
        with self.lock:
            holders = sorted({int(w) for w in op.worker_of[op.page_status == st.PENDING]})
            pids = [self.pool.workers[i].pid for i in holders if i < len(self.pool.workers)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.error("hicache_mp: op %d still had pages at worker(s) %s %.1f s after it was "
                  "abandoned; killed them so that no late I/O writes its host slots (they are "
                  "replaced)", op.id, holders, grace_s)

    def metrics(self) -> dict:
        return {"stuck_workers": self.stuck_workers, "stalled_pages": self.stalled_pages,
                "fenced_pages": self.ledger.fenced_pages}
