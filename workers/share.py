"""Reads first by time: how much of a worker's I/O time its writes may take while reads wait.

Owns one worker's write credit (nanoseconds) and its estimate of what a write
costs. Must not pick records or touch rings: workers.worker and workers.lanes
ask `may_write` and report each finished page.

The rule (docs/decisions.md 55): while a write waits, every read served earns
``io_ns * share / (1 - share)`` of credit; a write may start while reads wait
only if the credit covers its expected cost (an EWMA of this worker's
measured writes; before the first, the page at FIRST_WRITE_BPS), and is
charged its real time when it finishes. Over a stretch where reads and
writes both wait, writes then take at most `share` of the worker's I/O time
whatever their cost relative to a read. A count of pages cannot do that: on
the H200 box an 8 MiB write (O_DIRECT, ~60 ms) costs about twenty page-cache
reads (~3 ms).

A buffered write in flight is paused between its pieces while reads wait
and its credit does not cover the next piece (workers.worker.write_gate):
each piece run while reads waited is charged as it ends, so a write that
started free, just before a prefetch arrived, takes no more of the reads'
time than one piece plus its share.

Credit is earned only while a write waits (queued or paused), and capped (CREDIT_CAP_NS, or one
write's estimate if that is larger, so any write can become affordable), so
a read-only stretch banks nothing: a prefetch that meets a fresh backup
starts with no write ahead of its reads. A write that starts with no read
waiting anywhere (the worker's own ring empty and none outstanding at any
worker) costs no credit: then nothing is taken from a read. Writes are
never starved: the credit grows with every read served while they wait.
"""
import threading

CREDIT_CAP_NS = 1_000_000_000
FIRST_WRITE_BPS = 200e6  # a conservative first guess (a slow disk's O_DIRECT write)
EWMA_WEIGHT = 0.25       # of the newest measured write


class WriteShare:
    """Shared by a worker's loop (or dispatcher) and its lane threads: the
    updates take a lock, `may_write` reads two floats (atomic under the GIL)."""

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
