"""The I/O worker process: pops page records, moves bytes between files and the pool.

Run as ``python -m workers.worker hicache_mp-worker-<i> '<WorkerSpec json>'`` by
`WorkerPool`, through workers.child (a fresh interpreter: no CUDA state, no
inherited locks). Everything it is told is a `WorkerSpec` (workers.spec).
Imports no torch: os, mmap, numpy and posix_ipc only.

Owns the loop over the rings: which record next, the cancel check, the
stats and the completion. The page I/O itself goes through the page store
(workers.stores: `open_store(storage_dir)`), the only thing here that touches
files. Must not decide policy: it does what the records say and reports a
status for each.

Two submit rings per worker: `read_ring` (prefetch) and `write_ring`
(backup). Reads come first: a prefetch is on a request's critical path, a
backup is not. Writes are taken one at a time, on a thread of their own (at
io_depth 1 the write lane, workers.lanes.WriteLane; deeper, one of the
lanes): a page write can take the time of twenty page-cache reads, and a
read that arrives while it is in flight is served at once, beside it. When
a write may start, and when a buffered one paused between its pieces may go
on, is the write scheduler's to say (workers.share: `WriteScheduler`, reads
first by time, here and across every worker that makes progress); this loop
only asks it and reports each page to it.

Loop, with one exit path:
  1. pop up to `batch` records from the read ring; do each (after each,
     start one queued write if none is in flight and the credit covers it);
  2. else, if it is a write's turn (`WriteScheduler.turn`) and no write is in
     flight, pop one record from the write ring and start it on the write
     lane (which posts the wake semaphore when it is done);
  3. if neither had work: sleep on the wake semaphore (timeout: parent
     watch; DEFER_POLL_S while a write is deferred), go to 1;
  4. each record (`serve`): skip if its op is cancelled, else `start` its
     I/O on the store, then `complete` it: push a completion (status, io
     time), post the done semaphore if anyone waits. An asynchronous store
     would return from `start` at once and call `complete` when it reaps;
  5. leave when the control block says stop or the parent has gone. An
     orphan unlinks the names it knows, so a crashed scheduler leaves nothing
     in /dev/shm even if no engine ever starts again.

With `io_depth` > 1 (`--hicache-mp-io-depth`) the same choices are made by a
dispatcher, one record at a time, and `io_depth` threads of this process do
the I/O (the store's reads and writes release the GIL), so one worker keeps
that many page I/Os in flight; see workers.lanes for when that pays.

Capacity (when the engine sets storage limits): before a write the worker
reserves the file's bytes in its WRITTEN counter and checks the store
estimate (workers.control) and, with a free-space floor, statvfs; a write
that would cross a limit wakes the evictor and waits, on its own lane, a
bounded time for it to evict least recently used pages to make room
(workers.room); if none comes it is not attempted: status DROPPED (errno
ENOSPC). A successful read stamps the page's last access in the
store (the evictor's LRU order), so the scheduler makes no syscall for it.
"""
import errno
import os
import sys
import threading
import time

import numpy as np

from shm import PageGeometry, Ring, WakeSemaphore
from shm.hostpool import HostPool
from shm.partpool import PartPool
from workers import pagefile, status
from workers.child import ParentWatch, child_main, orphan_cleanup
from workers.lanes import Lane, WriteLane, run_lanes
from workers.records import KIND_PROBE, KIND_READ, KIND_WRITE
from workers.room import Room
from workers.share import WriteScheduler
from workers.spec import WorkerSpec
from workers.store import StoreIO
from workers.stores import open_store
from workers.timing import BACKOFF_S, DEFER_POLL_S, PARENT_CHECK_S
from workers.control import BUSY_NS, BYTES, INFLIGHT, INFLIGHT_KEY, MAX_BYTES, MIN_FREE, PAGES, \
    POSTED_NS, POSTED_SEQ, READS_DONE, READY_PID, WAITERS, WAKE_AT, WAKE_SEQ, WRITTEN, \
    Control, write_key


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.index = spec.index
        self.parent = ParentWatch(spec.parent_pid)
        self.geometry = PageGeometry.from_dict(spec.geometry)
        self.payload_len = self.geometry.page_bytes
        # Layer parts (decision 101): a slot holds one layer group of a page; the
        # file is still the whole page, of which a READ reads the group's runs.
        parts = spec.read_parts
        self.slot_geometry = self.geometry.layer_part(parts) if parts > 1 else self.geometry
        self.part_ranges = [self.geometry.part_file_ranges(parts, g) for g in range(parts)] \
            if parts > 1 else None
        self.read_bytes = self.slot_geometry.page_bytes
        self.direct = spec.direct_io
        self.store = open_store(spec.storage_dir, StoreIO(
            payload_len=self.payload_len, geometry_fp=self.geometry.fingerprint(),
            direct=self.direct, fsync=spec.fsync, write_crc=spec.write_checksum,
            verify_crc=spec.verify_checksum, require_crc=spec.require_checksum,
            quarantine=spec.quarantine_bad_files))
        self.batch = spec.worker_batch
        # pool_fd / pool_parts: the pool is a region (or several) the engine did not
        # create (SGLang's memfd host pools, hicache_mp.integrations), inherited
        # through Popen(pass_fds=...).
        if spec.pool_parts is not None:
            self.pool = PartPool(spec.pool_parts, spec.pool_pages, name=spec.pool_name,
                                 populate=spec.populate)
        else:
            self.pool = HostPool(self.slot_geometry, spec.pool_pages, name=spec.pool_name,
                                 create=False, populate=spec.populate, fd=spec.pool_fd)
        self.read_ring = Ring(spec.read_ring, spec.ring_capacity, create=False)
        self.write_ring = Ring(spec.write_ring, spec.ring_capacity, create=False)
        self.completion_ring = Ring(spec.completion_ring, spec.completion_capacity, create=False)
        self.wake = WakeSemaphore(spec.wake_sem, create=False)
        self.done = WakeSemaphore(spec.done_sem, create=False)
        self.control = Control(spec.control, create=False, num_workers=spec.num_workers)
        self.stats = self.control.workers[self.index]
        self.pushed = self.control.pushed[self.index:self.index + 1]   # workers.control: Pushed
        self.heartbeat = self.control.heartbeat[self.index]
        self.depth = spec.io_depth
        if self.depth == 1:  # reads on this thread alone (the write lane only writes)
            self.store.remember_leaves()
        self.lane = Lane(self.direct, 0)  # the loop's own; run_lanes makes one per thread
        self.file_bytes = pagefile.HEADER_SIZE + self.payload_len
        self.capped = spec.capacity
        self.evict_wake = WakeSemaphore(spec.evict_sem, create=False) if spec.evict_sem else None
        self.headroom = spec.evict_headroom
        self.num_workers = spec.num_workers
        self.room = Room(self.control, self.stats, self.evict_wake, self.file_bytes,
                         self.write_ring.pending)
        # Buffered writes pause between their pieces for reads; O_DIRECT ones go whole.
        self.writes = WriteScheduler(self.control, self.index, spec.num_workers,
                                     spec.write_share, self.payload_len, self.file_bytes,
                                     gated=not self.direct, stop=self._stopping)
        self.pid = os.getpid()
        # One producer at a time on the completion ring (SPSC), and the stats
        # words are read-modify-write: lane threads take this for both.
        self.push_lock = threading.Lock()

    # --- the loop -----------------------------------------------------------
    def run(self) -> int:
        self.stats[READY_PID] = self.pid
        try:
            orphaned = run_lanes(self) if self.depth > 1 else self._run_inline()
        finally:
            self.store.close()
        if orphaned:
            self._unlink_all()
        return 0

    def parent_gone(self) -> bool:
        return self.parent.gone()

    def _stopping(self) -> bool:
        return self.control.stopping() or self.parent_gone()

    def _run_inline(self) -> bool:
        """The loop of the module docstring, reads one at a time on this thread
        and the one write in flight on a `WriteLane`; True if orphaned."""
        writer = WriteLane(self)
        try:
            while not self.control.stopping():
                if self.parent_gone():
                    return True
                records = self.read_ring.pop(self.batch)
                if len(records):
                    for rec in records:
                        self.serve(rec, self.lane)
                        if not writer.busy and self.write_ring.pending() and self.writes.turn(True):
                            self._start_write(writer, True)  # reads first, writes never starved
                    continue
                if not writer.busy and self.write_ring.pending():
                    paid = self.writes.turn(False)
                    if paid is None:
                        self.wake.wait(DEFER_POLL_S)
                    else:
                        self._start_write(writer, paid)
                    continue
                # Woken by a submission, or by the write lane when its write is done.
                self.wake.wait(PARENT_CHECK_S)
            return False
        finally:
            writer.close()

    def _start_write(self, writer: WriteLane, paid: bool) -> None:
        recs = self.write_ring.pop(1)
        if len(recs):
            self.writes.taken(paid)
            writer.start(recs[0])

    def serve(self, rec, lane: Lane) -> None:
        t0 = time.perf_counter_ns()
        self.heartbeat[lane.slot] = time.monotonic_ns()  # the engine's watchdog looks at it
        lane.paused_ns = 0
        if rec["kind"] == KIND_WRITE:
            self.writes.started(t0)
        if rec["kind"] == KIND_PROBE:  # belongs to no op: never "cancelled"
            code, err = self._probe(rec["digest"].tobytes()), 0
        elif self.control.cancelled(int(rec["op_id"])):
            code, err = status.CANCELLED, 0
        else:
            code, err = self.start(rec, lane)
        io_ns = time.perf_counter_ns() - t0 - lane.paused_ns
        self.heartbeat[lane.slot] = 0
        self.complete(rec, lane, code, err, io_ns)

    def start(self, rec, lane: Lane) -> tuple[int, int]:
        """Do one record's page I/O on the store: (status, errno)."""
        digest = rec["digest"].tobytes()
        iovecs = self.pool.page_iovecs(int(rec["host_page"]))
        if rec["kind"] == KIND_READ:
            if self.part_ranges is None:
                return self.store.read(digest, iovecs, lane)
            return self.store.read(digest, iovecs, lane, self.part_ranges[int(rec["io_ns"])])
        if self.part_ranges is not None:  # the engine refuses backups first (EngineConfig.read_parts)
            return status.UNREADABLE, errno.EINVAL
        if self.capped:
            refused = self._reserve(digest, int(rec["op_id"]), lane)
            if refused:
                return refused
        code, err = self.store.write(digest, iovecs, lane)
        if self.capped:
            if code != status.OK:
                self.stats[WRITTEN] -= np.uint64(self.file_bytes)  # give the reservation back
            self.stats[INFLIGHT] = 0  # a scan from now on sees the file itself (or nothing)
        return code, err

    def complete(self, rec, lane: Lane, code: int, err: int, io_ns: int) -> None:
        """Report one record: stats, then its completion, then the done semaphore."""
        probe = rec["kind"] == KIND_PROBE
        nbytes = (self.read_bytes if rec["kind"] == KIND_READ else self.payload_len) \
            if code == status.OK and not probe else 0
        out = lane.out
        out[0] = rec
        out["status"][0] = code
        out["err"][0] = err
        out["io_ns"][0] = io_ns
        if rec["kind"] == KIND_WRITE:  # settled before anyone sees the write done
            self.writes.write_done(io_ns, code == status.OK)
        else:
            self.writes.read_done(io_ns, bool(self.write_ring.pending()))
        with self.push_lock:
            # Counted before the completion is pushed, so metrics() never shows
            # fewer pages than the engine has already seen complete. With lanes
            # BUSY_NS sums every lane's I/O time: busy fraction can pass 1.
            self.stats[BUSY_NS] += io_ns
            self.stats[PAGES] += not probe
            self.stats[BYTES] += nbytes
            if rec["kind"] == KIND_READ:
                self.stats[READS_DONE] += 1
                self.writes.read_counted()  # after READS_DONE: a paused write sees it
            while self.completion_ring.push(out) == 0:
                # The scheduler has not drained completions yet; it will. Never drop one.
                if self.parent_gone() or self.control.stopping():
                    return
                time.sleep(BACKOFF_S)
            self.pushed[0] += 1   # after the push: a poll that sees it finds the record
        if self.control.words[WAITERS]:  # read after the push (hicache_mp.engine.waiters, note 3)
            self._maybe_wake()

    def _maybe_wake(self) -> None:
        """The post side of the wake-up protocol (hicache_mp.engine.waiters, note 4).
        Post the waiter's semaphore: always when a waiter set no
        target (control: WAKE_AT); with one, once it is reached, once per
        target (WAKE_SEQ / POSTED_SEQ), and not while a post is pending:
        workers finishing a batch's last pages together each see the target
        reached, and a second post would end the waiter's next sleep at once
        for nothing (each sleep costs it a GIL hand-back under a busy
        scheduler). A skipped post is safe: the one pending or sent is
        consumed after this completion was pushed, and the waiter drains
        after waking, so it sees this one."""
        words = self.control.words
        at = int(words[WAKE_AT])
        if at:
            seq = int(words[WAKE_SEQ])
            if int(words[POSTED_SEQ]) == seq or self.done.pending() or \
                    self.control.pages_done() < at:
                return
            words[POSTED_SEQ] = seq
        words[POSTED_NS] = time.monotonic_ns()
        self.done.post()

    def _probe(self, digest: bytes) -> int:
        """Is this key's page in the store? One lookup (a read still checks the
        page). Answers the engine's discovery of pages other engines wrote
        (hicache_mp.engine.discovery)."""
        return status.OK if self.store.exists(digest) else status.MISS

    def _reserve(self, digest: bytes, op_id: int, lane: Lane) -> tuple[int, int] | None:
        """Claim this write's bytes against the store's limits; a refusal status or None.

        The reservation is made before the check, so two workers racing for the
        last bytes both see each other's claim (both may wait or refuse: the
        safe side). Over a limit the claim is kept while the write waits for
        room (workers.room), so the evictor frees room for it too.
        """
        nbytes = self.file_bytes
        # This order (key, INFLIGHT, WRITTEN) is the one workers.evictor's
        # count-once rule and its WRITTEN-first snapshot rely on.
        self.stats[INFLIGHT_KEY] = write_key(digest)
        self.stats[INFLIGHT] = nbytes
        self.stats[WRITTEN] += np.uint64(nbytes)
        over, near = self._over(digest)
        if near and self.evict_wake is not None:
            self.evict_wake.post()
        if over:
            if self.room.wait(lambda: self._over(digest)[0],
                              lambda: self._stopping() or self.control.cancelled(op_id), lane):
                return None
            self.stats[WRITTEN] -= np.uint64(nbytes)
            self.stats[INFLIGHT] = 0
            if self.control.cancelled(op_id):
                return status.CANCELLED, 0
            return status.DROPPED, errno.ENOSPC
        return None

    def _over(self, digest: bytes) -> tuple[bool, bool]:
        """(would this write, reserved, cross a limit; is a limit near)."""
        words, nbytes = self.control.words, self.file_bytes
        est = self.control.store_estimate()
        max_bytes, min_free = int(words[MAX_BYTES]), int(words[MIN_FREE])
        over = bool(max_bytes) and est > max_bytes
        near = bool(max_bytes) and est > max_bytes - self.headroom
        if min_free and not over:
            free = self.store.free_bytes(digest)  # on the drive this page goes to
            if free is not None:
                # Free space cannot show the other workers' writes in progress:
                # assume each has one page under way (a margin of a page per worker).
                claim = nbytes * self.num_workers
                over = free - claim < min_free
                near = near or free - claim < min_free + self.headroom
        return over, near

    def _unlink_all(self) -> None:
        orphan_cleanup(self.spec.orphan_shm, self.spec.orphan_sem)


def main(argv: list[str]) -> int:
    return child_main(argv, WorkerSpec.from_json, lambda spec: Worker(spec).run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
