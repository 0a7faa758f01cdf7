"""EngineCore: the scheduler-side half of every engine, over one I/O backend.

Owns the key namespace, the engine's lock and open/closed flags, starting
an op (input checks, then the books' admission), cancel, poll, blocking
waits and metrics; with its mixins, the exists index's calls
(hicache_mp.engine.lookups), close() (hicache_mp.engine.closing) and process ownership, a
forked child's refusal (hicache_mp.engine.ownership); the input checks are
hicache_mp.engine.checks. The books themselves (ops in flight, slots, pins,
counts, the landed order, the backup budget) are one object,
hicache_mp.engine.ledger.OpLedger (`_ledger`), changed only through its rules and
under the lock. Must not move page bytes: its I/O backend does
(hicache_mp.engine.iobackend: worker processes for `mp`, hicache_mp.engine.prefetch; Python
threads for the `file` and `fast_file` baselines, hicache_mp.bench), made
from the engine's narrow IOContext and feeding completions back through the
ledger.

Host slots named in an op are reserved from submit until the op is `done`
(every page accounted for), because an I/O may still be writing into them;
a second op naming a reserved slot is refused with ValueError.

Backups never hold more than `backup_budget_pages` host pages at once: the
pages of a backup that do not fit end at once with status DROPPED (counted in
`metrics()["write_status"]`, logged once), the leading ones are written. A
write-back that cannot keep up is thus shed at the door, never queued, and
`backup()` never waits.

Pages of ops in flight are pinned (the ledger's pins, a counting table by digest;
workers.control): the evictor never removes a pinned page. One vectorised add
per op and one decrement per completed page, no syscalls.
"""
import math
import threading
import time
from typing import Callable

from shm import PageGeometry
from workers import naming
from workers import status as st
from workers.stores import open_store
from workers.timing import ABANDON_GRACE_S, WAIT_SLICE_S

from .checks import check_pages, check_parts, check_pool_size, check_timeout
from .closing import Closing, EngineClosed, EngineForked
from .config import POLICIES, EngineConfig
from .discovery import Discovery
from .index import StoreIndex
from .iobackend import IOBackend, IOContext
from .ledger import OpLedger
from .lookups import IndexLookups
from .ops import READ, WRITE, Op
from .ownership import Ownership

__all__ = ["EngineCore", "EngineClosed", "EngineForked", "check_timeout"]


class EngineCore(IndexLookups, Closing, Ownership):
    def __init__(self, config: EngineConfig, geometry: PageGeometry,
                 make_io: Callable[[IOContext], IOBackend], *, background_scan: bool = False):
        """`make_io`: makes the engine's I/O backend from what it may use of
        the engine (hicache_mp.engine.iobackend), last, once the books exist.
        `background_scan`: the backend scans the store for the index off this
        process (its `rescan`; the `mp` engine, decision 110); else the
        constructor walks it here, and rescans run on a thread."""
        if not isinstance(geometry, PageGeometry):
            raise ValueError(f"geometry must be a PageGeometry, got {type(geometry).__name__}")
        # A slot holds a page, or one layer group of one with read_parts (decision
        # 101): the store's files, names and headers are the whole page's alike.
        self.slot_geometry = geometry.layer_part(config.read_parts)
        check_pool_size(self.slot_geometry.pool_bytes(config.host_pool_pages))
        self.config = config
        self.geometry = geometry
        self.namespace = naming.namespace(config.model_name, geometry.fingerprint(),
                                          tp_rank=config.tp_rank, tp_size=config.tp_size,
                                          extra=config.namespace_extra)
        self._store = open_store(config.storage_dir)  # for scans; workers open their own
        self._store.create()
        self._index = StoreIndex(self._store)
        self._background_scan = background_scan
        if not background_scan:
            self._index.scan()
        self._lock = threading.RLock()
        # The books (ops in flight, slots, pins, counts, the landed order):
        # one object, changed only through its rules, under the lock.
        self._ledger = OpLedger(config.host_pool_pages, config.resolved_backup_budget(),
                                self._index)
        self._closed = False
        self._released = False         # segments gone: nothing may touch the pool now
        self._init_ownership()         # this process's, until a fork (hicache_mp.engine.ownership)
        self._closing = False          # close() is flushing backups: no new work
        self._init_closing()           # close(), the sleepers (hicache_mp.engine.closing)
        self._start_ns = time.perf_counter_ns()
        self._last_rescan = time.monotonic()
        self._poll_calls = 0
        self._before_unmap = []      # on_close(): called first in close(), pool still mapped
        self._discovery = Discovery()
        self._io = make_io(IOContext(
            config=config, geometry=geometry, namespace=self.namespace, store=self._store,
            index=self._index, discovery=self._discovery, ledger=self._ledger, lock=self._lock,
            closed=lambda: self._closed, released=lambda: self._released,
            rescan=self._start_rescan, start_ns=self._start_ns))
        self.backend = self._io.name
        self.host_pool = self._io.host_pool
        # poll()'s fast path: a backend with nothing to do answers at once, with
        # no lock taken (issue 45: a busy loop polls every step). Not with
        # periodic rescans, whose clock poll() watches.
        self._quiet = None if config.rescan_interval_s else self._io.quiet
        self._own()

    # --- open, closed, forked -------------------------------------------------
    def _check_open(self) -> None:
        if self._forked:
            self._refuse_in_child()
        if self._closed:
            raise EngineClosed("engine is closed")

    def _closed_during(self, call: str, exc: Exception) -> Exception:
        """What a call raises for `exc`: EngineClosed if the engine was closed
        under it (what the released rings, semaphores and pool raise then is no
        error of the caller's, hicache_mp.engine.closing), else `exc` itself."""
        if isinstance(exc, EngineClosed) or not self._closed:
            return exc
        out = EngineClosed(f"engine was closed during {call}")
        out.__cause__ = exc
        return out

    # --- public API -----------------------------------------------------------
    def worker_count(self) -> int:
        """I/O workers (processes for `mp`, threads for `file`)."""
        return self._io.num_workers()

    def worker_pids(self) -> list:
        """Process ids of the I/O workers (`mp`; empty for in-process I/O)."""
        return self._io.pids()

    def prefetch(self, keys, host_pages, *, policy: str | None = None,
                 timeout_s: float | None = None, parts=None) -> Op:
        """Start reading pages for `keys` into `host_pages`; returns at once.
        `timeout_s` (the `timeout` policy's deadline): seconds, or None / inf for none.
        `parts`: with `read_parts` > 1 (decision 101), the layer group each
        position reads (a key may come once per group, each into its own slot)."""
        try:
            op = self._start(READ, keys, host_pages, policy, timeout_s, parts)
        except Exception as exc:
            raise self._closed_during("prefetch()", exc)
        if self._closed:  # closed while it was handed out: its pages end cancelled
            raise EngineClosed(f"engine was closed during prefetch(); the op ended {op.status}")
        return op

    def backup(self, keys, host_pages) -> Op:
        """Start writing `host_pages` to the store under `keys` (write-through)."""
        if self.config.read_parts > 1:
            raise ValueError(f"this engine reads pages in {self.config.read_parts} layer groups "
                             "and cannot write whole pages: back up through an engine with "
                             "read_parts=1 over the same store")
        try:
            op = self._start(WRITE, keys, host_pages, "wait_complete", None)
        except Exception as exc:
            raise self._closed_during("backup()", exc)
        if self._closed:  # closed while it was handed out: close() flushed or cancelled it
            raise EngineClosed(f"engine was closed during backup(); the op ended {op.status}")
        return op

    def cancel(self, op: Op) -> None:
        """Stop an op: pages not yet started are skipped; `completed_pages` freezes.

        The op is `done` (its slots free) once in-flight pages come back. On a
        closed engine there is nothing left to cancel (close() ended every op).
        """
        if self._forked:
            self._refuse_in_child()
        with self._lock:
            if op.done:
                return
            op.mark_cancelled()
            if not self._closed:
                try:
                    self._io.cancel(op)
                except Exception:
                    if not self._closed:  # else closed under us: close() ends the op
                        raise

    def abandon(self, op: Op, grace_s: float = ABANDON_GRACE_S) -> None:
        """Cancel `op` and return once nothing can write its host slots any more,
        even if an I/O of it is stuck (a hung network read): for a caller that must
        reuse the slots by a deadline (the SGLang adapter's io_timeout_s). Pages
        not done end cancelled, or worker_died where a stuck worker had to go."""
        self.cancel(op)
        self.wait(op)  # in-process I/O checks the cancel flag before each page

    def on_close(self, fn) -> None:
        """Call `fn()` first in `close()`, while the host pool is still mapped:
        for what holds a view of the pool that must end before it goes (a
        DeviceLoader's CUDA registration). The engine knows nothing else of
        it: the loader drives the engine (DeviceLoader.poll), not the other
        way round (issue 34)."""
        if self._forked:
            self._refuse_in_child()
        with self._lock:
            self._before_unmap.append(fn)

    def poll(self, lazy: bool = False) -> int:
        """Apply finished pages to their ops. Cheap and non-blocking: call every
        loop. EngineClosed once the engine is closed. `lazy`: only once an op
        may be done, a probe is answered or a ring fills (decision 88)."""
        quiet = self._quiet
        if quiet is not None and not self._closed and not self._forked and quiet():
            self._poll_calls += 1
            return 0
        self._check_open()
        try:
            with self._lock:
                self._poll_calls += 1
                n = self._io.drain(lazy)
                if self.config.rescan_interval_s and \
                        time.monotonic() - self._last_rescan > self.config.rescan_interval_s:
                    self._start_rescan()
        except Exception as exc:
            raise self._closed_during("poll()", exc)
        if self._closed:  # a signal handler closed it under this call
            raise EngineClosed("engine was closed during poll()")
        return n

    def wait(self, op: Op, timeout_s: float | None = None) -> bool:
        """Block (GIL released) until `op` is done (True) or the timeout passes (False).

        `timeout_s`: seconds, or None / inf for none. Signals do not end the wait
        early (an interrupted sleep is resumed within the deadline), but what a
        handler raises (SystemExit from sys.exit, KeyboardInterrupt) ends it and
        reaches the caller, the engine left consistent (decision 99). On a closed
        engine, also one closed meanwhile by another thread or by a signal
        handler that interrupted this wait, raises EngineClosed.
        """
        timeout_s = check_timeout(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                if self._closed:  # its pool may be gone: a caller must not read the slots
                    raise EngineClosed(f"engine is closed; the op ended {op.status}")
                self.poll()
                if op.done and not self._closed:
                    return True
                # A slice, then poll again (health, a closed engine); the mp
                # engine caps each sleep further (hicache_mp.engine.waiters, note 7).
                left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S,
                                                                 deadline - time.monotonic())
                if left <= 0:
                    return False
                self._sleep_counted(left, op)  # released: the loop's first line says so
        except Exception as exc:
            raise self._closed_during("wait()", exc)

    def metrics(self) -> dict:
        """Counters and rates; also on a closed engine (`close`: what close() did)."""
        if self._forked:
            self._refuse_in_child()
        try:
            return self._metrics()
        except Exception:
            if not self._closed:
                raise
            return self._metrics()  # closed under it: the closed engine's figures read no shm

    def _metrics(self) -> dict:
        with self._lock:
            now = time.perf_counter_ns()
            out = {"backend": self.backend, "workers": self._io.num_workers(),
                   "index_pages": len(self._index),
                   "stale_tmp_removed": self._index.stale_tmp_removed,
                   "poll_calls": self._poll_calls,
                   "page_bytes": self.geometry.page_bytes, "lazy_polls_skipped": 0}  # the backend's count, if it polls lazily
            # A read moves a slot's bytes: a layer group with read_parts (whose
            # engine writes nothing), else a page, as every write does.
            out.update(self._ledger.metrics(now, self.slot_geometry.page_bytes))
            out.update(self._io.metrics(now))
            # the index's scans, and whether the evictor has measured the store (mp)
            out["store_scan"] = {**self._index.scan_metrics(),
                                 "capacity": out.pop("store_capacity", None)}
            out["close"] = self._close_report
            return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def outcomes_applied(self) -> int:
        """Page outcomes applied to ops so far, engine-wide: moves whenever any
        op advances or ends."""
        return self._ledger.seq

    def if_outcomes_since(self, seen: int | None, fn):
        """`(count, fn())` if page outcomes were applied since the count
        `seen`, else `(seen, None)`; under the engine's lock, so what `fn`
        reads of the ops (completed_pages, done) is at least what the count
        says. A caller that follows ops' progress (DeviceLoader.step) looks
        at them only when something moved: one compare per scheduler step,
        however many are in flight (decision 83). The ledger bumps the count
        before it applies a batch, so a look outside the lock could take the
        new count with the old pages and never look again. An unchanged count
        needs no lock: any apply since the last look moved it first."""
        if self._ledger.seq == seen:
            return seen, None
        with self._lock:
            seq = self._ledger.seq
            if seq == seen:
                return seen, None
            return seq, fn()

    # --- shared bookkeeping -------------------------------------------------
    def _start(self, kind, keys, host_pages, policy, timeout_s, parts=None) -> Op:
        if self._forked:
            self._refuse_in_child()
        if self._closed or self._closing:
            raise EngineClosed("engine is closed")
        if timeout_s is not None:
            finite = check_timeout(timeout_s)
            timeout_s = math.inf if finite is None else finite
        if isinstance(keys, (str, bytes, bytearray)):
            # list("abc") would silently become three one-letter keys
            raise ValueError("keys must be a sequence of keys, not a single str or bytes")
        if policy is not None and policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        keys = list(keys)
        pages = check_pages(host_pages, len(keys), self.config.host_pool_pages)
        parts = check_parts(parts, len(keys), self.config.read_parts)
        ns = self.namespace
        digests = [naming.key_digest(k, ns) for k in keys]  # raises ValueError on a bad key
        with self._lock:
            if self._closed or self._closing:
                raise EngineClosed("engine is closed")
            self._io.check_accepting()
            ledger = self._ledger
            ledger.check_free(pages)
            op = Op(ledger.new_id(), kind, keys, pages, digests, self.slot_geometry.page_bytes,
                    policy or self.config.prefetch_policy,
                    self.config.prefetch_timeout_s if timeout_s is None else timeout_s)
            op.parts = parts
            if op.num_pages == 0:
                return op
            op.digest_bytes = b"".join(digests)  # the pins' and the records' (striping) source
            if not ledger.admit(op, time.perf_counter_ns()):
                return op
            self._io.submit(op)
            return op

    def _start_rescan(self) -> None:
        self._last_rescan = time.monotonic()
        if self._background_scan:
            self._io.rescan()
            return
        threading.Thread(target=self.refresh, name="hicache_mp-rescan", daemon=True).start()
