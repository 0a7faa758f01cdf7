"""Single-producer single-consumer ring of fixed 64-byte records in shared memory.

Owns the ring protocol. Must not know what a record means beyond its fields.

Region layout (all counters are monotonically increasing uint64):

    offset   0: head      written only by the consumer
    offset  64: tail      written only by the producer (own cache line: no false sharing)
    offset 128: capacity, record size (checked on attach)
    offset 192: capacity records of RECORD_DTYPE

Protocol: the producer writes records, then publishes `tail`; the consumer
reads `tail`, copies records out, then publishes `head`.

Platform assumption: on x86-64 an aligned 8-byte store is one instruction and
stores are not reordered with older stores, nor loads with older loads (TSO),
so "write records, then write tail" is seen in that order by the other side.
Elsewhere (weak memory order, e.g. aarch64) every push and pop runs under a
process-shared semaphore, whose acquire/release are full barriers.
"""
import platform

import numpy as np
import posix_ipc

from .gilkeep import assign, concat, copy
from .segment import Segment

RECORD_DTYPE = np.dtype([
    ("op_id", "<u8"),
    ("host_page", "<i8"),
    ("io_ns", "<u8"),       # on completion: time the worker spent on this page
    ("page_pos", "<u4"),    # position of the page within its op
    ("kind", "u1"),         # what the record is for: workers.records
    ("status", "u1"),       # on completion: a workers.status code
    ("err", "<u2"),         # on completion: the errno of a failed I/O (0: none)
    ("digest", "u1", (32,)),  # sha256 of (namespace, key): the page's identity
])
assert RECORD_DTYPE.itemsize == 64

_HEAD, _TAIL, _CAP, _RECSZ = 0, 8, 16, 17  # indexes into the uint64 counter view
_HEADER_BYTES = 192

TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def ring_bytes(capacity: int) -> int:
    return _HEADER_BYTES + capacity * RECORD_DTYPE.itemsize


class Ring:
    """One direction of traffic between the scheduler and one worker."""

    def __init__(self, name: str, capacity: int, *, create: bool, ordered_by_lock: bool = not TSO):
        if capacity <= 0:
            raise ValueError("ring capacity must be positive")
        self.name = name
        self.capacity = capacity
        self.segment = Segment(name, ring_bytes(capacity), create=create)
        buf = self.segment.map
        self._ctr = memoryview(buf)[:_HEADER_BYTES].cast("Q")
        if create:
            self._ctr[_CAP] = capacity
            self._ctr[_RECSZ] = RECORD_DTYPE.itemsize
        elif self._ctr[_CAP] != capacity or self._ctr[_RECSZ] != RECORD_DTYPE.itemsize:
            raise ValueError(f"ring {name}: capacity/record size mismatch")
        self._records = np.frombuffer(buf, dtype=RECORD_DTYPE, count=capacity, offset=_HEADER_BYTES)
        # the records as bytes, for pop_bytes
        self._raw = memoryview(buf)[_HEADER_BYTES:_HEADER_BYTES + capacity * RECORD_DTYPE.itemsize]
        self._lock = None
        if ordered_by_lock:
            flags = posix_ipc.O_CREX if create else 0
            self._lock = posix_ipc.Semaphore("/" + name + ".lk", flags, mode=0o600, initial_value=1)

    # --- both sides --------------------------------------------------------
    def depth(self) -> int:
        return self._ctr[_TAIL] - self._ctr[_HEAD]

    def reset(self) -> None:
        """Empty the ring for a new pair of users. Only while nothing else maps it
        (its old producer or consumer process is gone)."""
        self._ctr[_HEAD] = 0
        self._ctr[_TAIL] = 0

    def consumed(self) -> int:
        """Records the consumer has taken, ever (its progress, for a watchdog)."""
        return self._ctr[_HEAD]

    def pending(self) -> bool:
        """Records are waiting: the consumer's cheap check before `pop`."""
        ctr = self._ctr
        return ctr[_TAIL] != ctr[_HEAD]

    def free(self) -> int:
        return self.capacity - self.depth()

    # --- producer ----------------------------------------------------------
    def push(self, records: np.ndarray) -> int:
        """Append as many records as fit; return how many. Never blocks.

        A return value below len(records) is backpressure: the ring is full.
        """
        if self._lock:
            self._lock.acquire()
        try:
            tail = self._ctr[_TAIL]
            n = min(len(records), self.capacity - (tail - self._ctr[_HEAD]))
            if n <= 0:
                return 0
            start = tail % self.capacity
            first = min(n, self.capacity - start)
            assign(self._records[start:start + first], records[:first])
            if n > first:
                assign(self._records[:n - first], records[first:n])
            self._ctr[_TAIL] = tail + n  # publish after the records are written
            return n
        finally:
            if self._lock:
                self._lock.release()

    # --- consumer ----------------------------------------------------------
    def pop(self, max_records: int | None = None) -> np.ndarray:
        """Remove and return up to `max_records` records (a copy); empty if none."""
        out = self._take(max_records, self._copy_records)
        return _EMPTY if out is None else out

    def pop_bytes(self, max_records: int | None = None) -> bytes:
        """`pop` as the records' bytes (b"" if none): a consumer that joins
        several rings' records before reading them (hicache_mp.engine.draining)
        copies each ring once, with no numpy call."""
        out = self._take(max_records, self._copy_bytes)
        return b"" if out is None else out

    def _take(self, max_records, copy_out):
        """The consumer's protocol: copy the next records out with
        `copy_out(start, first, n)` (`first` of them before the wrap), then
        release their slots; None if there are none."""
        if self._lock:
            self._lock.acquire()
        try:
            head = self._ctr[_HEAD]
            n = self._ctr[_TAIL] - head
            if max_records is not None:
                n = min(n, max_records)
            if n <= 0:
                return None
            start = head % self.capacity
            out = copy_out(start, min(n, self.capacity - start), n)
            self._ctr[_HEAD] = head + n  # release the slots only after copying out
            return out
        finally:
            if self._lock:
                self._lock.release()

    def _copy_records(self, start: int, first: int, n: int) -> np.ndarray:
        if n > first:
            return concat((self._records[start:], self._records[:n - first]), RECORD_DTYPE)
        return copy(self._records[start:start + n])

    def _copy_bytes(self, start: int, first: int, n: int) -> bytes:
        size, raw = RECORD_DTYPE.itemsize, self._raw  # a slice's tobytes: one memcpy
        out = raw[start * size:(start + first) * size].tobytes()
        return out + raw[:(n - first) * size].tobytes() if n > first else out

    def close(self) -> None:
        del self._records
        self._raw.release()
        self._ctr.release()
        self.segment.close()
        if self._lock is not None:
            if self.segment.owner:
                try:
                    self._lock.unlink()
                except posix_ipc.ExistentialError:
                    pass
            self._lock.close()
            self._lock = None


_EMPTY = np.empty(0, dtype=RECORD_DTYPE)
