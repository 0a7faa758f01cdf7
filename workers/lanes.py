"""Depth per worker: several page I/Os in flight in one worker process.

Owns the lane threads of a worker and the dispatch that feeds them when
`io_depth` > 1: per-lane aligned buffers (`Lane`) and `run_lanes`, which
replaces the worker's inline loop; at depth 1, the inline loop's write lane
(`WriteLane`: its one write in flight, beside the loop's reads). Must not do
I/O or judge pages itself: each record goes through `Worker.serve`, as in
the inline loop.

Why threads inside the worker: preadv/pwritev release the GIL, so lanes of
one process run in the kernel at once, and a queue-depth-limited device
(NVMe, network filesystems: a lone synchronous 8 MiB read leaves it idle
between requests) sees `workers x io_depth` requests instead of `workers`,
without a process, a ring pair and a pool mapping per extra request.
Measured on the H200 box (scripts/bench_storage.py --io-depth): see
decision 19 (docs/decisions/) for the default that gave and why.

The rules the inline loop keeps still hold:
  - reads first: the dispatcher picks one record at a time, asking the
    worker's write scheduler as the inline loop does (workers.share:
    `WriteScheduler.turn`), and only when a lane is free, so a choice is
    never made early; the lane that finishes a write reports it
    (`Worker.complete`) before the dispatcher may pick the next one;
  - at most one write in flight per worker: a read never waits behind more
    than the writes already running, reads and writes run side by side, and
    the capacity reservation (one INFLIGHT word per worker) stays exact;
  - a buffered write pauses between its pieces when the scheduler says so
    (each lane's `gate`, `WriteScheduler.gate_for`); O_DIRECT writes go whole.
A lane that raises ends the whole worker process (as the inline loop
would): the engine then fails that worker's pages cleanly, rather than one
record silently never completing.
"""
import os
import queue
import sys
import threading
import traceback

import numpy as np

from shm.ring import RECORD_DTYPE
from workers import directio, pagefile
from workers.records import KIND_WRITE
from workers.timing import DEFER_POLL_S, PARENT_CHECK_S


class Lane:
    """One I/O lane's buffers.

    Header, overflow guard and write header live in one page-aligned scratch
    mapping: O_DIRECT needs aligned buffers, buffered I/O does not mind. The
    overflow guard catches a file longer than a page without an fstat:
    buffered, one spare byte; O_DIRECT, one spare aligned block (an iovec
    must be a whole block), which costs nothing at a true EOF.
    """

    def __init__(self, direct: bool, slot: int):
        self.slot = slot  # its heartbeat word (workers.control)
        # Called by the store between two pieces of a buffered write (None: the
        # write goes whole; `writing_lane` sets it); the time spent in it is
        # `paused_ns`, not I/O.
        self.gate = None
        self.paused_ns = 0
        self.scratch = directio.Scratch(3 * directio.ALIGN)
        self.header = self.scratch[0:pagefile.HEADER_SIZE]
        spare = directio.ALIGN if direct else 1
        self.overflow = self.scratch[directio.ALIGN:directio.ALIGN + spare]
        self.write_header = self.scratch[2 * directio.ALIGN:3 * directio.ALIGN]
        self.out = np.zeros(1, dtype=RECORD_DTYPE)


def writing_lane(worker, slot: int) -> Lane:
    """A lane that may run writes, with the gate the worker's write scheduler
    hands it (None: its writes go whole)."""
    lane = Lane(worker.direct, slot)
    lane.gate = worker.writes.gate_for(lane)
    return lane


class WriteLane:
    """The inline loop's (io_depth 1) write thread: the worker's one write in
    flight runs here, so the reads of a prefetch that arrives meanwhile are
    served by the loop at once instead of waiting for the write to finish
    (a page write can take the time of twenty page-cache reads). Posts the
    worker's wake semaphore when a write is done, so the loop can start the
    next one."""

    def __init__(self, worker):
        self.w = worker
        self.lane = writing_lane(worker, 1)  # heartbeat slot 1: the loop's own is 0
        self.busy = False
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="io-write", daemon=True)
        self._thread.start()

    def start(self, rec) -> None:
        self.busy = True
        self._work.put(rec)

    def close(self) -> None:
        """Let the write in flight finish, then end the thread."""
        self._work.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            rec = self._work.get()
            if rec is None:
                return
            try:
                self.w.serve(rec, self.lane)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(70)  # as a lane: the engine fails this worker's pages
            self.busy = False
            self.w.wake.post()


class _Dispatch:
    def __init__(self, worker):
        self.w = worker
        self.writing = False  # one write in flight at most (module docstring)

    def next_record(self):
        """The next record by the inline loop's priority rule, or None."""
        w = self.w
        if not self.writing and w.write_ring.pending():
            paid = w.writes.turn(bool(w.read_ring.pending()))
            if paid is not None:
                recs = w.write_ring.pop(1)
                if len(recs):
                    w.writes.taken(paid)
                    self.writing = True
                    return recs[0]
        recs = w.read_ring.pop(1)
        if len(recs):
            return recs[0]
        return None


def run_lanes(worker) -> bool:
    """Serve the worker's rings with `worker.depth` lanes until stop; True if orphaned."""
    w = worker
    free = threading.Semaphore(w.depth)
    work: queue.SimpleQueue = queue.SimpleQueue()
    dispatch = _Dispatch(w)
    lanes = [writing_lane(w, i) for i in range(w.depth)]
    threads = [threading.Thread(target=_lane_loop, args=(w, lane, work, free, dispatch),
                                name=f"io-lane-{lane.slot}", daemon=True) for lane in lanes]
    for t in threads:
        t.start()
    orphaned = False
    try:
        while not w.control.stopping():
            if w.parent_gone():
                orphaned = True
                break
            if not free.acquire(timeout=PARENT_CHECK_S):
                continue  # every lane busy: look at stop/parent again, then wait on
            rec = dispatch.next_record()
            if rec is None:
                free.release()
                # Woken by a submission, or by a lane whose write finished while
                # another write waited; a write deferred for reads elsewhere is
                # looked at again soon (nobody posts for those).
                deferred = not dispatch.writing and w.write_ring.pending()
                w.wake.wait(DEFER_POLL_S if deferred else PARENT_CHECK_S)
                continue
            work.put(rec)
    finally:
        for _ in threads:
            work.put(None)
        for t in threads:
            t.join()
    return orphaned


def _lane_loop(w, lane: Lane, work, free, dispatch: _Dispatch) -> None:
    while True:
        rec = work.get()
        if rec is None:
            return
        try:
            w.serve(rec, lane)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(70)  # see the module docstring: the engine fails this worker's pages
        if rec["kind"] == KIND_WRITE:
            dispatch.writing = False
            w.wake.post()
        free.release()
