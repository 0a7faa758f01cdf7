"""Reads first: when a worker's queued write may start, and when a paused one may go on.

Owns one worker's whole reads-first state: its write credit (`WriteShare`),
the write in flight's pieces and pause, how long a write has been deferred,
and what it has seen of the other workers' reads (`PeerReads`: which of them
still hold its writes back). `WriteScheduler` is what the worker asks. Must
not pick records, touch rings or do I/O: the worker's loop (workers.worker)
and its lanes (workers.lanes) ask `turn`, fit the lane `gate` it hands out,
and report each page taken, started and finished.

The credit (decision 55): while a write waits, every read served
earns ``io_ns * share / (1 - share)``; a write may start while reads wait
only if the credit covers its expected cost (an EWMA of this worker's
measured writes; before the first, the page at FIRST_WRITE_BPS), and is
charged its real time when it finishes. Over a stretch where reads and
writes both wait, writes then take at most `share` of the worker's I/O time
whatever their cost relative to a read. A count of pages cannot do that: an
8 MiB O_DIRECT write can cost the time of twenty page-cache reads. Credit is
earned only while a write waits (queued or paused), and capped (CREDIT_CAP_NS,
or one write's estimate if that is larger, so any write can become
affordable), so a read-only stretch banks nothing: a prefetch that meets a
fresh backup starts with no write ahead of its reads.

The turn (`WriteScheduler.turn`): free (uncharged) when no read waits here
nor is outstanding at any worker that makes progress: then nothing is taken
from a read. Else on credit. A write with no read of its own waiting that
has been deferred WRITE_DEFER_MAX_S by reads elsewhere goes anyway: writes are
never starved (their host pages stay pinned meanwhile).

Reads elsewhere (`PeerReads`): on one device every byte written is bandwidth
a read does not get (decision 20), so a worker's write waits for the reads
outstanding at every worker (READS_SUBMITTED - READS_DONE, workers.control),
but only at workers that make progress. One whose page I/O has run longer
than SLOW_IO_S (a read hung in the kernel) does not count, nor one that has
reads queued, no I/O running and has finished none for STILL_S (stopped by a
signal or a debugger, swapped out, descheduled): reads queued behind either
will not go sooner for our writes waiting. Each worker judges from what it
saw itself, so the interval starts at its first look that finds the reads
waiting. STILL_S is far above the gap between a healthy worker's two page
I/Os (microseconds; a wake-up after a submission, a few ms under load) and
below WRITE_DEFER_MAX_S, which would let the write go anyway.

The pause (`WriteScheduler.gate`): a buffered write goes in pieces
(workers.fileio) and between two the store calls the lane's gate: the piece
just written is charged if reads waited, and the next goes only when `turn`
would let a write of that size start. A write that started free, just before
a prefetch arrived, then takes no more of the reads' time than one piece
plus its share. O_DIRECT writes go whole (no gate): they wait on the device,
not on a core, and `turn` already rationed their device time.
"""
import threading
import time

import numpy as np

from workers.control import READS_DONE, READS_SUBMITTED
from workers.fileio import WRITE_PIECE_BYTES
from workers.timing import CREDIT_CAP_NS, DEFER_POLL_S, SLOW_IO_S, STILL_S, WRITE_DEFER_MAX_S

FIRST_WRITE_BPS = 200e6  # a conservative first guess (a slow disk's O_DIRECT write)
EWMA_WEIGHT = 0.25       # of the newest measured write


class WriteShare:
    """The credit. Shared by a worker's loop (or dispatcher) and its lane
    threads: the updates take a lock, `may_write` reads two floats (atomic
    under the GIL)."""

    def __init__(self, share: float, page_bytes: int):
        if not 0.0 < share < 1.0:
            raise ValueError(f"write_share must be > 0 and < 1, got {share!r}")
        self.rate = share / (1.0 - share)
        self.write_ns = page_bytes / FIRST_WRITE_BPS * 1e9
        self.credit_ns = 0.0
        self._lock = threading.Lock()

    def may_write(self, part: float = 1.0) -> bool:
        """Does the credit cover one more write (or `part` of one: a piece of a
        write already under way) while reads wait?"""
        return self.credit_ns >= self.write_ns * part

    def read_done(self, io_ns: int, writes_waiting: bool) -> None:
        if not writes_waiting:
            return
        with self._lock:
            cap = max(CREDIT_CAP_NS, self.write_ns)
            self.credit_ns = min(cap, self.credit_ns + io_ns * self.rate)

    def charge(self, io_ns: int) -> None:
        """A piece of a write ran `io_ns` while reads waited."""
        with self._lock:
            self.credit_ns -= io_ns

    def write_done(self, io_ns: int, charge_ns: int, measured: bool) -> None:
        """A write finished after `io_ns` of I/O (pauses not counted), the last
        `charge_ns` of it run while reads waited (charged now: pieces before
        it were charged as they ended); `measured`: it really wrote (update
        the estimate)."""
        with self._lock:
            self.credit_ns -= charge_ns
            if measured:
                self.write_ns += EWMA_WEIGHT * (io_ns - self.write_ns)


class PeerReads:
    """What one worker has seen of every worker's reads (module docstring:
    reads elsewhere). `hold()` is asked by one thread at a time in practice
    (a queued write's turn and a paused write's gate never overlap); a lock
    keeps the memory consistent if they do."""

    def __init__(self, control, num_workers: int):
        self.rows = control.workers[:num_workers]
        self.beats = control.heartbeat[:num_workers]
        self.done = np.zeros(num_workers, dtype=np.int64)
        self.waiting = np.zeros(num_workers, dtype=bool)
        self.moved_ns = np.zeros(num_workers, dtype=np.int64)
        self._lock = threading.Lock()

    def hold(self) -> bool:
        """Has a worker that makes progress reads outstanding?"""
        with self._lock:
            # READS_DONE before READS_SUBMITTED: the engine counts a read before
            # it queues it, so the later load can only be the larger.
            done = self.rows[:, READS_DONE].view(np.int64).copy()
            waiting = self.rows[:, READS_SUBMITTED].view(np.int64) > done
            if not waiting.any():
                self.done, self.waiting = done, waiting
                return False
            now = time.monotonic_ns()
            beats = self.beats.view(np.int64).copy()  # one snapshot: lanes move on
            in_io = (beats > 0).any(axis=1)
            beats[beats <= 0] = now
            stuck = in_io & (now - beats.min(axis=1) > SLOW_IO_S * 1e9)
            # Progress: a read finished, reads newly waiting (the interval starts
            # now), or a page I/O running that is not stuck.
            moved = (done != self.done) | (waiting & ~self.waiting) | (in_io & ~stuck)
            self.moved_ns[moved] = now
            self.done, self.waiting = done, waiting
            still = ~in_io & (now - self.moved_ns > STILL_S * 1e9)
            return bool((waiting & ~stuck & ~still).any())


class WriteScheduler:
    """One worker's reads-first decisions (module docstring). The worker's
    loop or dispatcher asks `turn` before it takes a queued write and reports
    it `taken`; `started` and `write_done` bracket the write's I/O on its
    lane; `read_done` and `read_counted` report each read (or probe)."""

    def __init__(self, control, index: int, num_workers: int, share: float, page_bytes: int,
                 file_bytes: int, *, gated: bool, stop):
        self.credit = WriteShare(share, page_bytes)
        self.peers = PeerReads(control, num_workers)
        self.row = control.workers[index]
        self.heartbeat = control.heartbeat[index]
        self.gated = gated
        self.stop = stop  # () -> bool: the worker is asked to stop or orphaned
        self.piece_part = min(1.0, WRITE_PIECE_BYTES / file_bytes)
        self.deferred_since = None  # monotonic time a waiting write was first deferred
        # The write in flight (one at most): is its current piece charged to the
        # credit (reads wait), when did that piece start, I/O time of the pieces
        # before it; is it paused at the gate.
        self.paid = False
        self.piece_t0 = 0
        self.pieces_ns = 0
        self.paused = False
        self.nudge = threading.Event()  # a read finished while a write was paused

    def turn(self, reads_here: bool, part: float = 1.0) -> bool | None:
        """May a queued write start now (or, `part` < 1, the next piece of a
        paused one go on)? None: not yet; True: yes, on credit (reads wait: it
        is charged); False: yes, free. `reads_here`: reads wait in this
        worker's own ring."""
        if not reads_here and not self.peers.hold():
            self.deferred_since = None
            return False
        if self.credit.may_write(part):
            self.deferred_since = None
            return True
        if reads_here:
            return None  # the reads served here earn the credit
        now = time.monotonic()
        if self.deferred_since is None:
            self.deferred_since = now
        if now - self.deferred_since >= WRITE_DEFER_MAX_S:
            self.deferred_since = None
            return False
        return None

    def taken(self, paid: bool) -> None:
        """A write was taken from the ring on `turn`'s answer `paid`."""
        self.paid = bool(paid)

    def started(self, t0_ns: int) -> None:
        """The write taken begins its I/O (perf_counter_ns)."""
        self.piece_t0, self.pieces_ns = t0_ns, 0

    def gate_for(self, lane):
        """The gate a writing lane hands the store, or None: the write goes whole."""
        return (lambda: self.gate(lane)) if self.gated else None

    def gate(self, lane) -> None:
        """Between two pieces of a buffered write: charge the piece just written
        if reads waited, then let the next go only when `turn` would let a
        write of that size start. Until then the write is paused: its thread
        sleeps (it takes no core from the reads, and no device time), woken by
        each read done here or every DEFER_POLL_S (reads elsewhere end
        unannounced). A pause is not I/O: it counts in no io_ns (`lane.paused_ns`)
        and shows in no heartbeat, so the engine's watchdog and `PeerReads`
        never see a paused write as a stuck one. A stop or a gone parent lets
        the write finish."""
        now = time.perf_counter_ns()
        piece = now - self.piece_t0
        self.pieces_ns += piece
        if self.paid:
            self.credit.charge(piece)
        paid = self._piece_turn()
        if paid is None:
            self.heartbeat[lane.slot] = 0
            self.paused = True
            try:
                while paid is None and not self.stop():
                    self.nudge.wait(DEFER_POLL_S)
                    self.nudge.clear()
                    paid = self._piece_turn()
            finally:
                self.paused = False
            self.heartbeat[lane.slot] = time.monotonic_ns()
        self.paid = bool(paid)
        t = time.perf_counter_ns()
        lane.paused_ns += t - now
        self.piece_t0 = t

    def _piece_turn(self) -> bool | None:
        reads_here = int(self.row[READS_SUBMITTED]) > int(self.row[READS_DONE])
        return self.turn(reads_here, self.piece_part)

    def read_done(self, io_ns: int, writes_queued: bool) -> None:
        """A read (or probe) took `io_ns`; `writes_queued`: writes wait in the ring."""
        self.credit.read_done(io_ns, self.paused or writes_queued)

    def read_counted(self) -> None:
        """READS_DONE has counted a read: a paused write may look again."""
        if self.paused:
            self.nudge.set()

    def write_done(self, io_ns: int, ok: bool) -> None:
        """The write finished after `io_ns` of I/O (pauses not counted)."""
        last = io_ns - self.pieces_ns  # the pieces before it were charged as they ended
        self.credit.write_done(io_ns, last if self.paid else 0, ok)
