"""PrefetchEngine: the `mp` backend. The scheduler's side of the worker pool.

    caller (scheduler loop)           PrefetchEngine                      WorkerPool
    -----------------------           --------------                      ----------
    prefetch(keys, slots) ──► check input, reserve slots, build one
                              64-byte record per page (numpy, one array
                              per op), stripe over workers ──────────────► submit_ring[i]
                              post wake[i] once per batch                   (worker i reads the
    poll() every loop     ──► pop completion rings (counters + small        file straight into
                              records), advance ops, free slots ◄────────── the pool slot)
    op.completed_pages        leading pages landed, in order
    backup(keys, slots)   ──► same road, on each worker's write ring (served
                              after its read ring); pages over the backup
                              budget end DROPPED at once; workers write
                              temp + rename (O_DIRECT when the store allows)
    close()               ──► pool shutdown protocol, unlink every segment

    with storage limits:      EvictorProcess (workers.evictor) keeps the store
                              under them; poll() pops its evict ring and the
                              index forgets those pages

Direct I/O is decided once, at start (workers.directio.resolve): off, or the
store's filesystem accepts O_DIRECT and the geometry's page runs are 4096-byte
aligned; otherwise buffered, logged once.

The scheduler never blocks and never touches page bytes here. Every segment
and semaphore is named ``hicache_mp.<pid>.<random>.*`` and unlinked by
`close()`, by the finaliser on garbage collection or interpreter exit, by
orphaned workers when this process dies, and by `clean_stale()` at the next
start otherwise.

Failure states (checked every HEALTH_CHECK_S from poll(), never blocking it):
  - a worker dies: its unfinished pages end WORKER_DIED (ops end partial or
    failed); a replacement starts in the background and takes work once
    ready, meanwhile new pages go to the other workers;
  - a worker is stuck (watchdog: one page I/O older than `stall_timeout_s`,
    from the per-lane heartbeat in the control block): it is SIGKILLed, every
    page it still holds ends WORKER_DIED at once (counted in `stalled_pages`),
    and it is replaced as above. Its pages' host slots stay reserved (fenced)
    until the killed process is reaped: a page reported failed is never
    written into its slot later, whatever the kernel finishes meanwhile;
  - a replacement cannot be started: the pool is broken (`BrokenPool`, one
    terminal state in workers.pool), and every later prefetch or backup
    says so; a healthy engine never does.
"""
import os
import signal
import threading
import time
import weakref

import numpy as np

from shm import PageGeometry, WakeSemaphore, clean_stale, gilkeep, new_owner_tag
from shm.hostpool import HostPool
from shm.partpool import Part, PartPool
from shm.ring import RECORD_DTYPE, ring_bytes
from shm.segment import check_room
from workers import directio, naming, pagefile
from workers import status as st
from workers.control import BUSY_NS, BYTES, CONTROL_BYTES, MAX_BYTES, MIN_FREE, PAGES, \
    POSTED_NS, READS_SUBMITTED, STOP, WAITERS, WAKE_AT, WAKE_SEQ, Control
from workers.evictor import EVICT_RING_CAPACITY, EvictorProcess, headroom_bytes
from workers.pool import BrokenPool, WorkerPool, worker_cpus
from workers.records import KIND_PROBE, KIND_READ, KIND_WRITE
from workers.spec import WorkerSpec
from workers.timing import ABANDON_GRACE_S, HEALTH_CHECK_S, NO_TARGET_CAP_S, TARGET_CAP_S

from .config import EngineConfig
from .core import EngineClosed, EngineCore, check_timeout, log
from .discovery import PROBE_MAX
from .nodeshare import NodeShare
from .ops import READ, Op

# A waiter with a wake-up target sleeps until its batch is done or this
# long: each early expiry takes the GIL back once, which under a busy
# scheduler costs up to a switch interval, so a long batch must not be cut
# into 20 ms naps (the cap is for a worker that dies mid-batch).


# The completions of one op in one drain go through EngineCore._apply_many from
# this many up, else page by page. Bulk has a fixed cost of ~90 µs per call on
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
        (hicache_mp.nodeshare).
        """
        super().__init__(config, geometry)
        self.stale_removed = clean_stale()
        self.tag = new_owner_tag()
        self._segments = []
        self._pool = None
        self._evictor = None
        self._fences: list = []     # (killed stuck worker, host slots held until it is reaped)
        self._stuck_workers = 0
        # Sleeps ended by a worker's post, by the cap; posted wakes that found
        # their target not reached (a post left over from an earlier wait); and
        # leftover posts taken before a sleep (never slept on).
        self._wakeups = [0, 0, 0, 0]
        self._targets: list = []  # wake-up target of each thread in wait(); 0: none
        self._leader = None         # the thread that sleeps on done_sem for all (_sleep_for_completion)
        self._woken = threading.Condition(self._lock)
        self._gil_delay_s = 0.0  # EWMA: a worker's post -> the waiter runs again
        self._stalled_pages = 0
        if pool_fd is not None and pool_parts is not None:
            raise ValueError("give pool_fd or pool_parts, not both")
        parts = None
        if pool_parts is not None:
            parts = [Part(*(int(x) for x in p)) for p in pool_parts]
            if sum(p.stride for p in parts) != geometry.page_bytes:
                raise ValueError(f"pool_parts: strides add up to {sum(p.stride for p in parts)} "
                                 f"bytes, the geometry's page is {geometry.page_bytes}")
        self.shared_pool = pool_fd is not None or parts is not None
        self.direct_io, self.direct_io_reason = directio.resolve(
            config.direct_io, self._store.roots, geometry, config.host_pool_pages,
            config.storage_max_bytes,
            page_runs=None if parts is None else (lambda page: [p.run(page) for p in parts]))
        if config.direct_io != "off":
            # One line per engine: a filesystem that refuses is worth a warning; an
            # unaligned geometry (small test pages) is expected, so only info.
            fs_refused = self.direct_io_reason.startswith("buffered I/O: O_DIRECT on")
            (log.warning if fs_refused else log.info)("hicache_mp: %s", self.direct_io_reason)
        share = None
        if config.num_workers:
            workers = config.num_workers
        else:  # auto: this engine's share of the node's cores (decision 42)
            share = NodeShare(config.node_engines, aux_cap=aux_workers)
            workers = share.workers
        ring_capacity = config.resolved_ring_capacity(workers)
        # Everything this engine puts in /dev/shm, counted before any of it is made:
        # each segment is allocated in full at creation (shm.segment), so what fits
        # now can never be taken away by another process filling /dev/shm later.
        try:
            check_room(shm_bytes(0 if self.shared_pool else
                                 geometry.pool_bytes(config.host_pool_pages),
                                 workers, ring_capacity, config.capacity_limited),
                       f"this engine's shared memory (host pool, control block, rings of "
                       f"{workers} workers)")
        except BaseException:
            if share is not None:
                share.close()
            raise
        if share is not None:  # released last, with the segments
            self._segments.append(share)
        try:
            own_fd = None
            if pool_fd is not None:
                own_fd = _OwnedFd(os.dup(pool_fd))
                self._segments.append(own_fd)  # closed after what maps it: segments close in reverse
                need = geometry.pool_bytes(config.host_pool_pages)
                have = os.fstat(own_fd.fd).st_size
                if have < need:
                    raise ValueError(f"pool_fd holds {have} bytes; the geometry needs {need} "
                                     f"for {config.host_pool_pages} pages")
            own_parts = None
            if parts is not None:
                dups = {}
                for fd in sorted({p.fd for p in parts}):
                    dups[fd] = _OwnedFd(os.dup(fd))
                    self._segments.append(dups[fd])
                own_parts = [Part(dups[p.fd].fd, p.offset, p.stride) for p in parts]
                self.host_pool = PartPool(own_parts, config.host_pool_pages,
                                          name=self.tag + ".pool", populate=config.populate,
                                          closed_error=EngineClosed)
            else:
                self.host_pool = HostPool(geometry, config.host_pool_pages,
                                          name=self.tag + ".pool", create=own_fd is None,
                                          populate=config.populate,
                                          fd=None if own_fd is None else own_fd.fd,
                                          closed_error=EngineClosed)
            self._segments.append(self.host_pool)
            self._control = Control(self.tag + ".ctl", create=True)
            self._segments.append(self._control)
            self._pins = self._control.pins  # the evictor reads the same table
            self.done_sem = WakeSemaphore(self.tag + ".done", create=True)
            self._segments.append(self.done_sem)
            headroom = 0
            orphan_shm = [self.host_pool.name, self._control.name]
            orphan_sem = [self.done_sem.name]
            if config.capacity_limited:
                file_bytes = pagefile.HEADER_SIZE + geometry.page_bytes
                headroom = headroom_bytes(config.storage_max_bytes, config.storage_min_free_bytes,
                                          file_bytes)
                if config.storage_max_bytes and config.storage_max_bytes < 2 * headroom + file_bytes:
                    raise ValueError(f"storage_max_bytes={config.storage_max_bytes} holds too few "
                                     f"pages of {file_bytes} bytes; give it at least "
                                     f"{2 * headroom + file_bytes}")
                self._control.words[MAX_BYTES] = config.storage_max_bytes
                self._control.words[MIN_FREE] = config.storage_min_free_bytes
                self._evictor = EvictorProcess(tag=self.tag, control=self._control,
                                              storage_dir=config.storage_dir,
                                              interval_s=config.eviction_interval_s,
                                              headroom=headroom)
                self._segments.append(self._evictor)
                self._evictor.start(config.worker_start_timeout_s)
                orphan_shm.append(self._evictor.ring.name)
                orphan_sem.append(self._evictor.wake.name)
            spec = WorkerSpec(
                storage_dir=config.storage_dir, geometry=geometry.to_dict(),
                pool_name=self.host_pool.name, pool_pages=config.host_pool_pages,
                pool_fd=None if own_fd is None else own_fd.fd,
                pool_parts=None if own_parts is None else
                tuple((p.fd, p.offset, p.stride) for p in own_parts),
                populate=config.populate,
                verify_checksum=config.verify_checksum, write_checksum=config.write_checksum,
                fsync=config.fsync, require_checksum=config.require_checksum,
                quarantine_bad_files=config.quarantine_bad_files,
                worker_batch=config.worker_batch, write_share=config.write_share,
                direct_io=self.direct_io, io_depth=config.resolved_io_depth(self.direct_io),
                num_workers=workers, capacity=config.capacity_limited,
                evict_sem=self._evictor.wake.name if self._evictor else None,
                evict_headroom=headroom, control=self._control.name, done_sem=self.done_sem.name,
                ring_capacity=ring_capacity, orphan_shm=tuple(orphan_shm),
                orphan_sem=tuple(orphan_sem))
            pin = worker_cpus() if config.pin_workers else None
            self._pool = WorkerPool(num_workers=workers, tag=self.tag, control=self._control,
                                   spec=spec, ring_capacity=ring_capacity, pin_cpus=pin,
                                   start_timeout_s=config.worker_start_timeout_s)
        except BaseException:
            self._release_shm()
            raise
        self._rr = 0
        self._evictor_failed = None
        self._last_health = time.monotonic()
        self._watched_at, self._watch_from_ns = time.monotonic(), 0  # _watchdog's gap rule
        # Segments go even if the caller forgets close() or an exception unwinds.
        self._finalizer = weakref.finalize(self, _cleanup, os.getpid(), self._pool,
                                           list(self._segments))

    # --- hooks ----------------------------------------------------------------
    def _check_accepting(self) -> None:
        self._pool.check()

    def _submit(self, op: Op) -> None:
        n = op.num_pages
        recs = _records(b"".join(op.digests), KIND_READ if op.kind == READ else KIND_WRITE)
        recs["op_id"] = op.id
        gilkeep.assign(recs["host_page"], op.host_pages)
        gilkeep.assign(recs["page_pos"], gilkeep.iota(n))
        # Ready workers only; with none ready (all being replaced), pages wait in
        # the replacements' rings (workers.pool).
        workers = self._pool.usable() or self._pool.starting
        if not workers:
            raise BrokenPool("no worker can take work")
        nw = len(workers)
        # Stripe pages over workers, page j to worker (start + j) % nw, so every
        # worker walks its share in op order and the leading pages land first.
        start = self._rr % nw
        self._rr = (start + n) % nw
        index_of = np.array([h.index for h in workers], dtype=np.uint16)
        op.worker_of = index_of[(gilkeep.iota(n, start)) % nw]
        rejected = []
        writes = op.kind != READ
        if writes and gilkeep.any_(op.page_status != st.PENDING):
            todo = op.page_status == st.PENDING  # pages over the backup budget are already dropped
        else:
            todo = None
        for offset in range(min(n, nw)):
            handle = workers[(start + offset) % nw]
            share = recs[offset::nw]
            if todo is not None:
                share = share[todo[offset::nw]]
                if not len(share):
                    continue
            if writes:
                pushed = handle.write.push(share)
            else:
                # Counted before the push: a worker may finish a page before we
                # could count it after (workers.control: reads outstanding).
                counts = self._control.workers[handle.index]
                counts[READS_SUBMITTED] += np.uint64(len(share))
                pushed = handle.submit.push(share)
                counts[READS_SUBMITTED] -= np.uint64(len(share) - pushed)
            if pushed:
                handle.wake.post()
            if pushed < len(share):
                rejected.extend(share["page_pos"][pushed:].tolist())
        if rejected:
            now = time.perf_counter_ns()
            for pos in rejected:  # backpressure: say so per page, never queue unbounded
                self._apply(op, pos, st.BUSY, 0, 0, now)

    def _probe(self, keys, whole: bool) -> set:
        """Hand probes for `keys` (the first is missing from the index; the
        others too with `whole`) to the workers; the digests still
        unanswered among them (hicache_mp.discovery)."""
        if self._pool is None or self._pool.closed or self._pool.broken:
            return set()
        workers = self._pool.usable()
        if not workers:
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
            recs = _records(b"".join(ask), KIND_PROBE)
            gilkeep.assign(recs["host_page"], -1)
            nw = len(workers)
            sent = []
            for i in range(min(nw, len(ask))):
                handle = workers[(self._rr + i) % nw]
                pushed = handle.submit.push(recs[i::nw])
                if pushed:
                    handle.wake.post()
                    sent.extend(ask[i::nw][:pushed])  # a full ring: those are asked next time
            self._rr = (self._rr + len(ask)) % nw
            disc.mark(sent, now)
        return disc.waiting.intersection(asked)

    def _drain(self) -> int:
        if self._pool is None or self._pool.closed:
            return 0
        n = 0
        for handle in self._pool.workers:
            # Most polls find nothing: keep them to a load each.
            if not handle.rings_closed and handle.completion.pending():
                n += self._drain_ring(handle.completion)
        if self._evictor is not None and self._evictor.ring.pending():
            discard = self._index.digests.discard
            for digest in self._evictor.pop()["digest"]:
                discard(digest.tobytes())
        if time.monotonic() - self._last_health > HEALTH_CHECK_S:
            self._last_health = time.monotonic()
            self._health()
        return n

    def _drain_ring(self, ring) -> int:
        recs = ring.pop()
        n = len(recs)
        if not n:
            return 0
        probes = recs["kind"] == KIND_PROBE
        if gilkeep.any_(probes):
            hits = self._discovery.answered(recs["digest"][probes].tobytes(),
                                            (recs["status"][probes] == st.OK).tolist())
            add = self._index.add
            for digest in hits:
                add(digest)
            recs = recs[~probes]
            n = len(recs)
            if not n:
                return 0
        now = time.perf_counter_ns()
        # One worker's completions in the order it did them: that order is the
        # engine-wide landed order (Op.landed_seq), also across ops.
        seq0 = self._seq
        self._seq += n
        self._worker_pages += n
        op_ids = recs["op_id"]
        if n < BATCH_APPLY_MIN:
            groups = [(None, None)]
        elif gilkeep.all_(op_ids == op_ids[0]):
            groups = [(op_ids[0], None)]
        else:
            # dict, not np.unique: a sort lets the GIL go (shm.gilkeep)
            groups = [(i, np.flatnonzero(op_ids == i)) for i in dict.fromkeys(op_ids.tolist())]
        for op_id, at in groups:
            part = recs if at is None else recs[at]
            if op_id is None or len(part) < BATCH_APPLY_MIN:
                seqs = range(seq0, seq0 + n) if at is None else (seq0 + at).tolist()
                self._apply_each(part, seqs, now)
                continue
            op = self._ops.get(int(op_id))
            if op is not None:
                seqs = gilkeep.iota(n, seq0) if at is None else seq0 + at
                self._apply_many(op, part["page_pos"], part["status"], part["io_ns"],
                                 part["flags"], seqs, now)
        return n

    def _apply_each(self, recs, seqs, now: int) -> None:
        ops = self._ops
        for op_id, pos, code, io_ns, err, seq in zip(
                recs["op_id"].tolist(), recs["page_pos"].tolist(), recs["status"].tolist(),
                recs["io_ns"].tolist(), recs["flags"].tolist(), seqs):
            op = ops.get(op_id)
            if op is not None:
                self._apply(op, pos, code, io_ns, err, now, seq)

    def _health(self) -> None:
        """Watch the children: none of this waits for a process (module docstring)."""
        self._replace_dead()
        ready, failed = self._pool.poll_starting()
        for handle in ready:
            log.info("hicache_mp-worker-%d (pid %d) is ready", handle.index, handle.pid)
        for handle in failed:
            n = len(self._fail_pages(handle.index))
            log.warning("hicache_mp-worker-%d's replacement did not start (%s); %d page(s) "
                        "failed; trying again", handle.index, handle.start_error, n)
            self._respawn(handle)
        # Fences lift before the watchdog looks: a worker killed in this pass is
        # never reaped in it, so its slots stay fenced at least until the next.
        for handle in self._pool.reaped():
            for fenced, slots in self._fences:
                if fenced is handle:
                    self._reserved[slots] = False
            self._fences = [f for f in self._fences if f[0] is not handle]
            if handle.respawn_after_reap:
                handle.respawn_after_reap = False
                self._respawn(handle)
        self._watchdog()

    def _fail_pages(self, index: int, fence: bool = False) -> np.ndarray:
        """End every page still pending at worker `index` WORKER_DIED; their host
        slots, which that worker may still write, when `fence`. Returns the slots."""
        now = time.perf_counter_ns()
        slots = []
        for op in list(self._ops.values()):
            lost = np.flatnonzero((op.worker_of == index) & (op.page_status == st.PENDING))
            if not len(lost):
                continue
            slots.append(op.host_pages[lost])
            for pos in lost.tolist():
                self._apply(op, pos, st.WORKER_DIED, 0, 0, now)
        slots = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
        if fence:
            self._reserved[slots] = True
        return slots

    def _replace_dead(self) -> None:
        ev = self._evictor
        if ev is not None and not self._pool.closed:
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
        for handle in self._pool.dead():
            if not handle.rings_closed:
                self._drain_ring(handle.completion)  # what it finished before dying still counts
            failed = len(self._fail_pages(handle.index))
            log.warning("hicache_mp-worker-%d (pid %d) died with exit code %s; %d in-flight "
                        "page(s) failed; starting a replacement", handle.index, handle.pid,
                        handle.proc.returncode, failed)
            # A worker killed mid-write leaves its temp file behind (never a page: it
            # does not end in .page). A rescan, off this thread, reaps temp files of
            # dead writers now rather than at the next start, and indexes pages it
            # renamed into place just before dying.
            self._start_rescan()
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
        stalled = self._control.stalled(len(self._pool.workers), limit,
                                        since_ns=self._watch_from_ns)
        for handle in self._pool.usable():
            idle = handle.idle_with_work_s(now, limit / 4)
            if idle > limit:
                stalled[handle.index] = max(stalled[handle.index], idle)
        if not stalled.any():
            return
        for index in np.flatnonzero(stalled).tolist():
            handle = self._pool.workers[index]
            if handle.stuck or handle in self._pool.starting or not handle.alive():
                continue
            age_s = float(stalled[index])
            handle.stuck = True
            handle.child.kill()
            self._drain_ring(handle.completion)  # pages it did finish are good
            slots = self._fail_pages(index, fence=True)
            self._fences.append((handle, slots))
            self._stuck_workers += 1
            self._stalled_pages += len(slots)
            log.error("hicache_mp-worker-%d (pid %d) is stuck: no progress for %.1fs, over "
                      "stall_timeout_s=%ss; killed, %d page(s) failed (their host slots stay "
                      "reserved until it is gone); starting a replacement", index, handle.pid,
                      age_s, self.config.stall_timeout_s, len(slots))
            self._respawn(handle)

    def _respawn(self, handle) -> None:
        try:
            self._pool.respawn(handle)
        except BrokenPool as exc:
            log.error("hicache_mp: %s; the engine takes no more work", exc)

    def abandon(self, op: Op, grace_s: float = ABANDON_GRACE_S) -> None:
        """EngineCore.abandon: after `grace_s` for workers to skip the cancelled
        pages, a worker still holding one is stuck inside a page I/O that may yet
        write a slot. It is killed, and this returns once it is gone (the health
        check fails its pages and replaces it), so no slot is written afterwards."""
        grace_s = check_timeout(grace_s, "grace_s")
        self.cancel(op)
        if self.wait(op, grace_s):
            return
        with self._lock:
            holders = sorted({int(w) for w in op.worker_of[op.page_status == st.PENDING]})
            pids = [self._pool.workers[i].pid for i in holders if i < len(self._pool.workers)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.error("hicache_mp: op %d still had pages at worker(s) %s %.1f s after it was "
                  "abandoned; killed them so that no late I/O writes its host slots (they are "
                  "replaced)", op.id, holders, grace_s)
        self.wait(op)

    def _cancel_io(self, op: Op) -> None:
        self._control.cancel(op.id)

    def _sleep_for_completion(self, timeout_s: float, op=None) -> None:
        # The lock makes the counter update atomic across waiting threads (SGLang
        # blocks in several: its backup thread in batch_set_v1 while its I/O
        # thread waits in batch_get_v1) and keeps the rings single-consumer.
        # One of them, the leader, sleeps on the completion semaphore with the
        # lock (and the GIL) released; the others wait on `_woken`, which the
        # leader notifies once it woke and drained: a post wakes whichever
        # thread sleeps on a semaphore, so two on it woke each other's pages.
        # Each waiter on an op sets the point at which its pages are surely done
        # (control: WAKE_AT) and the workers post at the lowest, so each thread
        # wakes about once per batch of their own, not once per page anyone moved;
        # a waiter on no op: after every completion. Set before the
        # announcement, so no worker sees a waiter without it.
        # The leader is a thread, not a flag: a call nested on the leader's own
        # thread (from a signal handler that interrupted its sleep) leads in
        # its turn, since that sleep is not asleep while the handler runs. A
        # close() under any of it (also nested) releases the control block and
        # the semaphore: from then on nothing here touches them (`_released`),
        # and a sleep on the closed semaphore ends at once (shm.wake).
        me = threading.get_ident()
        with self._lock:
            if self._released:
                return
            words = self._control.words
            target = op is not None and not op.done
            at = self._worker_pages + op._remaining if target else 0
            cap = min(timeout_s, TARGET_CAP_S if target else NO_TARGET_CAP_S)
            prev = self._leader
            lead = prev is None or prev == me
            if lead and at:
                # Nobody sleeps on the semaphore now, so a post still pending is
                # left over from a wait that ended without sleeping (its last page
                # drained just before the worker posted): taken here with the GIL
                # held, it cannot end this sleep at once for a GIL hand-back.
                self._wakeups[3] += self.done_sem.take_pending()
            self._targets.append(at)
            self._set_wake_at()
            words[WAITERS] += 1
            # Re-check after announcing ourselves: a completion pushed before the
            # announcement posted nothing. The cap covers the remaining race.
            drained = self._drain()
            if drained or not lead:
                try:
                    if drained:
                        self._woken.notify_all()  # those pages may end a follower's op
                    elif not self._closed:
                        self._count_wake(self._woken.wait(cap), at, follower=True)
                finally:
                    self._leave(at)
                return
            self._leader = me
        posted = False
        try:
            # Each sleep gives the GIL up and takes it back on waking: counted
            # (posted wake-ups and cap expiries) so the GIL cost of a batch
            # can be measured (scripts/sglang_stack.py prints it).
            posted = self.done_sem.wait(cap)
        finally:
            with self._lock:
                self._leader = prev
                self._count_wake(posted, at)
                if not self._closed:
                    self._drain()  # the followers' ops too, before they look
                self._woken.notify_all()
                self._leave(at)

    def _set_wake_at(self) -> None:
        """WAKE_AT for the waiters now: the lowest target, 0 if any has none.
        Each new target is numbered (WAKE_SEQ) before it is set: a post for an
        old one never counts."""
        if self._released:
            return
        words = self._control.words
        at = 0 if not self._targets or 0 in self._targets else min(self._targets)
        if at:
            words[WAKE_SEQ] += 1
        words[WAKE_AT] = at

    def _leave(self, at: int) -> None:
        self._targets.remove(at)
        if self._released:  # the control block is gone: nobody counts waiters now
            return
        self._control.words[WAITERS] -= 1
        self._set_wake_at()

    def _count_wake(self, posted: bool, at: int, follower: bool = False) -> None:
        self._wakeups[0 if posted else 1] += 1
        if not posted or not at or follower or self._released:
            return
        if gilkeep.total(self._control.workers[:, PAGES]) < at:
            self._wakeups[2] += 1
        else:  # from the worker's post to running again: the GIL's price
            delay = (time.monotonic_ns() - int(self._control.words[POSTED_NS])) / 1e9
            self._gil_delay_s += 0.25 * (delay - self._gil_delay_s)

    def _shutdown_io(self) -> None:
        self._control.words[STOP] = 1  # the evictor watches it too
        if self._pool is not None:
            self._pool.stop()
            for handle in self._pool.workers:  # pages finished before the stop still count
                if not handle.rings_closed:
                    self._drain_ring(handle.completion)
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
            if not handle.rings_closed and (handle.submit.depth() or handle.write.depth() or
                                            handle.completion.pending()):
                return False
        return not self._control.heartbeat[:len(self._pool.workers)].any()

    def _wake_sleepers(self) -> None:
        """The leader (it alone sleeps on the semaphore) and its followers;
        called by close() with the lock held. A leader on the caller's own
        thread is interrupted, not asleep: it finds the engine closed."""
        me = threading.get_ident()
        if self._leader is not None and self._leader != me:
            self.done_sem.post()
        self._woken.notify_all()

    def _forget_resources(self) -> None:
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()

    def _release_shm(self) -> None:
        # With the pool: normally closed already (_shutdown_io); not when a
        # close() from a signal handler interrupted that one while it stopped
        # the workers (hicache_mp.closing), whose rings then go here.
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        _cleanup(os.getpid(), getattr(self, "_pool", None), self._segments)
        self._segments = []

    def _num_workers(self) -> int:
        return len(self._pool) if self._pool else 0

    def _worker_pids(self) -> list:
        return [h.pid for h in self._pool.workers] if self._pool else []

    def _io_metrics(self, now_ns: int) -> dict:
        wall = (now_ns - self._start_ns) / 1e9
        stats = self._control.workers[:len(self._pool)] if self._pool and not self._closed else []
        return {
            "worker_busy": [round(int(s[BUSY_NS]) / 1e9 / wall, 4) if wall else 0.0 for s in stats],
            "worker_pages": [int(s[PAGES]) for s in stats],
            "wait_wakeups_posted": self._wakeups[0], "wait_wakeups_timeout": self._wakeups[1],
            "wait_wakeups_stale": self._wakeups[2],
            "wait_leftover_posts_taken": self._wakeups[3],
            "wait_gil_delay_ms": round(self._gil_delay_s * 1e3, 3),
            "worker_bytes": [int(s[BYTES]) for s in stats],
            "ring_depth": [0 if h.rings_closed else h.submit.depth() + h.write.depth()
                           for h in self._pool.workers] if self._pool else [],
            "write_ring_depth": [0 if h.rings_closed else h.write.depth()
                                 for h in self._pool.workers] if self._pool else [],
            "respawns": self._pool.respawns if self._pool else 0,
            "workers_starting": len(self._pool.starting) if self._pool else 0,
            "stuck_workers": self._stuck_workers,
            "stalled_pages": self._stalled_pages,
            "fenced_pages": sum(len(s) for _, s in self._fences),
            "broken": self._pool.broken if self._pool else None,
            "direct_io": self.direct_io,
            "direct_io_reason": self.direct_io_reason,
            "io_depth": self.config.resolved_io_depth(self.direct_io),
            "backup_budget_pages": self._backup_budget,
            "backup_pages_held": self._write_pages,
            "evictor_respawns": self._evictor.respawns if self._evictor else 0,
            "evicted_pages": self._evictor.evicted_pages if self._evictor else 0,
            "evicted_bytes": self._evictor.evicted_bytes if self._evictor else 0,
            "store_bytes_estimate": self._control.store_estimate()
            if self._evictor and not self._closed else None,
            "stale_segments_removed": len(self.stale_removed),
            "probes_sent": self._discovery.sent,
            "probes_found": self._discovery.found,
            "shared_pool": self.shared_pool,
        }


# RECORD_DTYPE with the digest as one 32-byte field: a record's digest is then
# one element to numpy, not 32 (its copy loops count elements; shm.gilkeep).
_RECORD_V32 = np.dtype({"names": list(RECORD_DTYPE.names),
                        "formats": [RECORD_DTYPE.fields[k][0] if k != "digest" else "V32"
                                    for k in RECORD_DTYPE.names],
                        "offsets": [RECORD_DTYPE.fields[k][1] for k in RECORD_DTYPE.names],
                        "itemsize": RECORD_DTYPE.itemsize})


def _records(digests: bytes, kind: int) -> np.ndarray:
    """Zeroed records of `kind` for 32-byte digests joined end to end."""
    n = len(digests) // 32
    recs = gilkeep.zeros(n, _RECORD_V32)
    gilkeep.assign(recs["digest"], np.frombuffer(digests, dtype="V32"))
    gilkeep.assign(recs["kind"], kind)
    return recs.view(RECORD_DTYPE)


def shm_bytes(pool_bytes: int, workers: int, ring_capacity: int, evictor: bool) -> int:
    """/dev/shm bytes an engine allocates: pool, control block, every worker's two
    submit rings and completion ring (twice as long), the evict ring, and a
    page per semaphore (tmpfs rounds each file up to one)."""
    per_worker = 2 * ring_bytes(ring_capacity) + ring_bytes(2 * ring_capacity) + 4096
    extra = ring_bytes(EVICT_RING_CAPACITY) + 4096 if evictor else 0
    return pool_bytes + CONTROL_BYTES + workers * per_worker + extra + 4096


class _OwnedFd:
    """The engine's dup of a caller's pool descriptor; closing it is all it does."""

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _cleanup(owner_pid: int, pool, segments) -> None:
    if os.getpid() != owner_pid:  # a forked child's exit: the parent's, never ours to release
        return
    if pool is not None:
        pool.close()
    for seg in reversed(segments):
        try:
            seg.close()
        except Exception:
            pass
