"""The control block: one small shared segment the engine, all workers and the evictor see.

Owns the fields that are not per-record traffic: the stop flag, the number of
threads blocked waiting for completions, each worker's ready pid and busy
counters, the cancel table, the store-capacity counters and the pin table.
Must not carry page records (rings do).

Every field is an aligned uint64, written by exactly one side:

    STOP, WAITERS, MAX_BYTES, MIN_FREE, WAKE_AT,  engine
    WAKE_SEQ
    POSTED_NS, POSTED_SEQ                         the worker that posts a wake-up
    STORE_BASE, WRITTEN_AT_SCAN, EVICTOR_PID,     evictor
    EVICT_PASSES, EVICT_REMOVED
    SCANNER_PID                                   the store scanner (workers.scanner)
    per worker: READY_PID, BUSY_NS, PAGES, BYTES, WRITTEN, INFLIGHT,
                INFLIGHT_KEY, READS_DONE, WANT                      that worker
    per worker: READS_SUBMITTED                   engine (and reset, with
                READS_DONE, by the pool before a worker's replacement starts)
    HEARTBEAT[worker][lane] = CLOCK_MONOTONIC ns  that worker's lane (0: idle;
                the pool zeroes a slot's row before its replacement starts)
    CANCEL[op_id % CANCEL_SLOTS] = op_id          engine
    PUSHED[worker] = completions pushed           that worker (after each push)
    PINS[h(digest)] = pages of ops in flight      engine

Capacity estimate (workers/evictor.py): the store holds about
``STORE_BASE + sum(WRITTEN) - WRITTEN_AT_SCAN`` bytes. The evictor stores
STORE_BASE before WRITTEN_AT_SCAN and readers load WRITTEN_AT_SCAN first, so
on x86 (TSO) a reader that sees a half-published update over-estimates,
never under-estimates. WRITTEN is what each worker has reserved in all (it
reserves a file's bytes before writing it, and gives them back if the write
fails); INFLIGHT is the reservation of the write it is doing now, which a
directory scan may not see yet: the evictor adds it to STORE_BASE, unless
its scan met that write's result. INFLIGHT_KEY names that write
(`write_key` of its digest; stored before INFLIGHT, left in place after) so
the evictor can tell the write's own temp file and page file in its scan
and count the write once (workers/evictor.py: counting a write once).

Room at the limit (workers/room.py): a write that would cross a limit keeps
its reservation and waits briefly for the evictor, its worker's WANT saying
how many bytes of writes wait behind the limit there (the one waiting and
those queued on its write ring); the evictor frees that much more than its
hysteresis asks, then counts the pass (EVICT_REMOVED, the pages it removed,
stored before EVICT_PASSES), so a waiter can tell a pass that started after
it asked and removed nothing: no room is coming.

Reads outstanding: READS_SUBMITTED - READS_DONE of a worker is the number of
read pages the engine has handed it and it has not finished. A worker with a
write to do and no read of its own waiting defers the write while another
worker that makes progress has reads outstanding (workers.share: reads first
across the whole engine, not only within one worker's rings; a worker whose
I/O is stuck, or that takes none of its queued reads, does not count). The
engine adds to READS_SUBMITTED before it pushes, so READS_DONE never passes
it: a racing reader may see a read outstanding a moment before it is queued
(a write waits a moment longer), never a negative count. A dead worker's
pair is zeroed before its replacement starts, so its lost reads do not stay
outstanding.

Wake-up target (the protocol's numbered note is hicache_mp/engine/waiters.py's
docstring; notes 1-4 are these words): while threads wait on ops, WAKE_AT is the lowest sum of
every worker's PAGES at which one of those ops is surely done (the engine's
count of completions it has drained, plus that op's pages outstanding: a
worker counts a page before it pushes its completion, so the sum reaches it
no later than the op's last push). A worker posts the completion semaphore
only once the sum reaches it, so a batch wakes its waiter about once instead
of once per page; 0 means post after every completion (a waiter on no op).
Each target is posted once: the engine numbers its targets (WAKE_SEQ), and the worker that posts first marks that number (POSTED_SEQ),
so the workers completing pages after it, while the waiter is still taking
the GIL back (WAITERS is still set), post nothing more: a post left over
would end the waiter's next sleep at once, for a GIL hand-back. A late mark
carries an old number, so it never silences a newer sleep. The poster
stores the monotonic clock in POSTED_NS first, so the waiter can tell how
long it took to run again (the `wait_gil_delay_ms` metric).

Heartbeat: a lane stores the monotonic clock (system-wide, so the engine can
compare it with its own) when it starts a page I/O and 0 when it ends. The
engine's watchdog (hicache_mp.engine.supervisor) looks for an I/O older than its stall
limit with one vectorised compare per health check.

Pushed: each worker adds 1 to its PUSHED word after every completion it
pushes (probes too), so a poll can tell "no ring has anything new" from
one contiguous read of the engine's workers' words instead of a load of
every ring's counters, a cache line each that its worker keeps writing
(issue 45: 14 rings cost an empty poll most of its 5-6 µs on the GPU box).
The engine reads them before it pops the rings: a completion pushed before
that reading is popped by the drain it starts (x86 stores are seen in order:
the ring's tail before the word); one pushed after it changes the words, so
the next poll drains. The words only grow (a replacement worker goes on
from its slot's count), so a reading equal to the last one means nothing
was pushed since.

Pins: a counting table indexed by the first 8 bytes of the page digest
(sha256: uniform). The engine adds 1 per page when an op is submitted and
takes it off when that page completes; the evictor never removes a page whose
slot is non-zero. Two digests sharing a slot only make a page look pinned a
little longer: safe.
"""
import time

import numpy as np

from shm import Segment, gilkeep

MAX_WORKERS = 256
MAX_LANES = 32   # io_depth bound: one heartbeat word per lane
CANCEL_SLOTS = 4096
PIN_SLOTS = 1 << 16
_WORKER_FIELDS = 10
STOP, WAITERS, STORE_BASE, WRITTEN_AT_SCAN, MAX_BYTES, MIN_FREE, EVICTOR_PID, WAKE_AT, \
    POSTED_NS, WAKE_SEQ, POSTED_SEQ, EVICT_PASSES, EVICT_REMOVED, SCANNER_PID = range(14)
_WORKERS_AT = 14
_CANCEL_AT = _WORKERS_AT + MAX_WORKERS * _WORKER_FIELDS
_PINS_AT = _CANCEL_AT + CANCEL_SLOTS
_HEARTBEAT_AT = _PINS_AT + PIN_SLOTS
_PUSHED_AT = _HEARTBEAT_AT + MAX_WORKERS * MAX_LANES
_TOTAL = _PUSHED_AT + MAX_WORKERS
CONTROL_BYTES = _TOTAL * 8
READY_PID, BUSY_NS, PAGES, BYTES, WRITTEN, INFLIGHT, READS_SUBMITTED, READS_DONE, \
    INFLIGHT_KEY, WANT = range(_WORKER_FIELDS)


def pin_slots(digests: bytes) -> np.ndarray:
    """Pin-table slots of 32-byte digests joined end to end (each one's first
    8 bytes, little-endian, modulo the table; pin_slot for one)."""
    # as intp: a uint64 index array is cast inside numpy's fancy indexing, a
    # loop that may let the GIL go (shm.gilkeep)
    return (np.frombuffer(digests, dtype="<u8")[::4] % PIN_SLOTS).astype(np.intp)


def pin_slot(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") % PIN_SLOTS


def write_key(digest: bytes) -> int:
    """The INFLIGHT_KEY word naming a write of this page (its digest's first 8 bytes)."""
    return int.from_bytes(digest[:8], "little")


class Control:
    def __init__(self, name: str, *, create: bool, num_workers: int = MAX_WORKERS):
        if not 0 < num_workers <= MAX_WORKERS:
            raise ValueError(f"num_workers={num_workers}: 1 to {MAX_WORKERS}")
        self.segment = Segment(name, CONTROL_BYTES, create=create)
        self.num_workers = num_workers
        self.words = np.frombuffer(self.segment.map, dtype=np.uint64, count=_TOTAL)
        self.workers = self.words[_WORKERS_AT:_CANCEL_AT].reshape(MAX_WORKERS, _WORKER_FIELDS)
        self.cancel_table = self.words[_CANCEL_AT:_PINS_AT]
        self.pins = self.words[_PINS_AT:_HEARTBEAT_AT]
        self.heartbeat = self.words[_HEARTBEAT_AT:_PUSHED_AT].reshape(MAX_WORKERS, MAX_LANES)
        self.pushed = self.words[_PUSHED_AT:_TOTAL]
        # The engine's workers' PUSHED words, contiguous (a few cache lines where
        # the rings' own counters are one line each): bytes() of it is one memcpy.
        self._pushed_bytes = memoryview(self.segment.map)[_PUSHED_AT * 8:
                                                          (_PUSHED_AT + num_workers) * 8]

    @property
    def name(self) -> str:
        return self.segment.name

    def stopping(self) -> bool:
        return bool(self.words[STOP])

    def pages_done(self) -> int:
        """Every worker's PAGES summed (a page is counted before its
        completion is pushed: hicache_mp.engine.waiters, note 1); the GIL held.
        Only the engine's own workers' words: a lazy poll (decision 88) reads
        this on every call, and all MAX_WORKERS words cost it 6 us of 8."""
        return gilkeep.total(self.workers[:self.num_workers, PAGES])

    def pushed_view(self) -> memoryview:
        """The engine's workers' PUSHED words, for a reader that takes bytes() of
        them on every poll without a call here: equal to an earlier reading only
        if no worker has pushed a completion since (Pushed, above). Valid while
        this Control is open."""
        return self._pushed_bytes

    def cancelled(self, op_id: int) -> bool:
        return self.cancel_table[op_id % CANCEL_SLOTS] == op_id

    def cancel(self, op_id: int) -> None:
        self.cancel_table[op_id % CANCEL_SLOTS] = op_id

    def stalled(self, num_workers: int, limit_s: float, now_ns: int | None = None,
                since_ns: int = 0) -> np.ndarray:
        """Per worker: how long its oldest page I/O has run (s) if over `limit_s`,
        else 0; an I/O started before `since_ns` counts from then (the caller
        was not looking before)."""
        hb = self.heartbeat[:num_workers].view(np.int64).copy()  # one snapshot: lanes move on
        now = time.monotonic_ns() if now_ns is None else now_ns
        idle = hb <= 0
        np.maximum(hb, since_ns, out=hb)
        hb[idle] = now
        age = (now - hb.min(axis=1)) / 1e9
        return np.where(age > limit_s, age, 0.0)

    def store_estimate(self) -> int:
        """Bytes the store holds, as far as this engine knows (see the module doc)."""
        at = int(self.words[WRITTEN_AT_SCAN])   # load order matters: see module doc
        base = int(self.words[STORE_BASE])
        return base + int(self.workers[:, WRITTEN].sum()) - at

    def close(self) -> None:
        del self.words, self.workers, self.cancel_table, self.pins, self.heartbeat
        self.segment.close()
