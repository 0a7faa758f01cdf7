"""Op handles: what a caller holds for one prefetch or backup.

Owns per-op progress: page statuses, the leading run of landed pages, the
final status and the policy question "may the scheduler go on now?". Must not
talk to workers; the engine feeds completions in.
"""
import time

import numpy as np

from shm import gilkeep
from workers import status as st

_OK_BYTE = bytes([st.OK])

READ, WRITE = "read", "write"
NO_DEADLINE_S = 1e9             # a timeout this long (or inf) is no timeout
NO_DEADLINE_NS = 1 << 62


class Op:
    __slots__ = ("id", "kind", "keys", "host_pages", "digests", "num_pages", "page_status",
                 "worker_of", "policy", "deadline", "_lead", "pages_left", "_cancelled",
                 "_frozen_lead", "submit_ns", "done_ns", "first_ns", "io_ns", "ok_pages",
                 "page_bytes", "landed_ns", "device_event", "pin_slots", "pins_unique",
                 "digest_bytes", "landed_seq", "parts")

    def __init__(self, op_id: int, kind: str, keys, host_pages: np.ndarray, digests: list,
                 page_bytes: int, policy: str, timeout_s: float):
        self.id = op_id
        self.kind = kind
        self.keys = keys
        self.host_pages = host_pages
        self.digests = digests
        self.num_pages = len(host_pages)
        self.page_status = gilkeep.zeros(self.num_pages, np.uint8)
        self.worker_of = None
        self.policy = policy
        self.submit_ns = time.perf_counter_ns()
        self.deadline = self.submit_ns + int(timeout_s * 1e9) if timeout_s < NO_DEADLINE_S \
            else NO_DEADLINE_NS
        self._lead = 0
        self.pages_left = self.num_pages
        self._cancelled = False
        self._frozen_lead = 0
        self.done_ns = self.submit_ns if self.num_pages == 0 else 0
        self.first_ns = 0
        self.io_ns = 0
        self.ok_pages = 0
        self.page_bytes = page_bytes
        self.landed_ns = gilkeep.zeros(self.num_pages, np.int64)  # for profiling
        # Engine-wide order in which pages completed (one worker's completions
        # arrive in the order it did them): shows read-over-write priority.
        self.landed_seq = gilkeep.full(self.num_pages, -1, np.int64)
        self.pin_slots = None  # set by the engine at submit
        self.pins_unique = False  # no pin slot twice in the op: so in no part of it either
        self.digest_bytes = b""  # the digests joined, set by the engine at submit
        self.device_event = None
        self.parts = None  # with read_parts: the layer group per position (engine.checks.check_parts)

    # --- fed by the engine --------------------------------------------------
    # The ledger (engine/ledger.py) is the one writer of an op's progress.
    # record_page, record_pages, hold_failed, release_held and mark_cancelled
    # are public so that it needs no reach into this class, not for callers:
    # a caller holding an Op reads it (done, status, completed_pages,
    # pages_left) and cancels through the engine's cancel(), which also stops
    # the I/O.
    def record_page(self, pos: int, code: int, io_ns: int, now_ns: int) -> bool:
        """Record one page's outcome; True if this finished the op."""
        if self.page_status[pos] != st.PENDING:
            return False  # a page already failed by a worker death; ignore a late echo
        self.page_status[pos] = code
        self.landed_ns[pos] = now_ns
        self.io_ns += io_ns
        if not self.first_ns:
            self.first_ns = now_ns
        if code == st.OK:
            self.ok_pages += 1
            ps = self.page_status
            while self._lead < self.num_pages and ps[self._lead] == st.OK:
                self._lead += 1
        self.pages_left -= 1
        if self.pages_left == 0:
            self.done_ns = now_ns
            return True
        return False

    def record_pages(self, pos, codes, io_ns: int, now_ns: int) -> bool:
        """`record_page` for pages known to be pending (the engine filtered them)."""
        self.page_status[pos] = codes
        self.landed_ns[pos] = now_ns
        self.io_ns += io_ns
        if not self.first_ns:
            self.first_ns = now_ns
        ok = gilkeep.count(codes == st.OK)
        if ok:
            self.ok_pages += ok
            # the leading run of OK bytes, by bytes.lstrip (C, GIL held: numpy's
            # argmax may let the GIL go; shm.gilkeep)
            rest = self.page_status[self._lead:].tobytes()
            self._lead += len(rest) - len(rest.lstrip(_OK_BYTE))
        self.pages_left -= len(pos)
        if self.pages_left == 0:
            self.done_ns = now_ns
            return True
        return False

    def hold_failed(self, pos, code: int, now_ns: int) -> None:
        """Pages failed while a killed worker may still write their slots: their
        status is final now, but they stay in pages_left, so the op is not
        done (its slots not free) until release_held() counts them."""
        self.page_status[pos] = code
        self.landed_ns[pos] = now_ns
        if not self.first_ns:
            self.first_ns = now_ns

    def release_held(self, n: int, now_ns: int) -> bool:
        """`n` held pages' slots are safe again (the worker is gone); True if
        this finished the op."""
        self.pages_left -= n
        if self.pages_left == 0:
            self.done_ns = now_ns
            return True
        return False

    def mark_cancelled(self) -> None:
        """Freeze completed_pages at its value now (engine.cancel() and close())."""
        if not self._cancelled and not self.done:
            self._cancelled = True
            self._frozen_lead = self._lead

    # --- what callers read --------------------------------------------------
    @property
    def cancelled(self) -> bool:
        """cancel() was called (pages not yet started are skipped)."""
        return self._cancelled

    @property
    def completed_pages(self) -> int:
        """Leading pages that landed, in order. Frozen at cancel time."""
        return self._frozen_lead if self._cancelled else self._lead

    @property
    def done(self) -> bool:
        """Every page is accounted for: the host slots may be reused."""
        return self.pages_left == 0

    @property
    def status(self) -> str:
        if not self.done:
            return "cancelling" if self._cancelled else "running"
        if self._cancelled:
            return "cancelled"
        if self._lead == self.num_pages:
            return "ok"
        return "partial" if self.completed_pages > 0 else "failed"

    def ready(self, now_ns: int | None = None) -> bool:
        """May the scheduler stop waiting for this op, under its policy?"""
        if self.done or self.policy == "best_effort":
            return True
        if self.policy == "timeout":
            return (now_ns or time.perf_counter_ns()) >= self.deadline
        return False

    def status_counts(self) -> dict:
        codes, counts = np.unique(self.page_status, return_counts=True)
        return {st.NAMES[int(c)]: int(n) for c, n in zip(codes, counts)}

    @property
    def seconds(self) -> float:
        end = self.done_ns or time.perf_counter_ns()
        return (end - self.submit_ns) / 1e9

    @property
    def gbps(self) -> float:
        s = self.seconds
        return self.ok_pages * self.page_bytes / s / 1e9 if s > 0 else 0.0

    def __repr__(self) -> str:
        return (f"Op(id={self.id}, {self.kind}, pages={self.num_pages}, "
                f"completed={self.completed_pages}, status={self.status})")
