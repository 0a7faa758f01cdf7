"""Draining: the workers' completion rings and the evict ring into the engine's books.

Owns popping each ring, joining what the rings held into one drain, telling
probe answers (to discovery and the index) from page completions, the evict
ring (the index forgets those pages), a share of the store scan's ring per
drain (hicache_mp.engine.storescan) and the lazy poll's question "may the
rings hold what someone waits for?". Must not decide what a completion means
for an op or a slot, nor number it: the ledger does (hicache_mp.engine.ledger,
`settle`); nor look at processes (hicache_mp.engine.supervisor). It holds the
ledger, the discovery table and the index it feeds, never the engine.

Runs inside poll() on the scheduler's thread, under the engine's lock: a
poll that finds nothing costs one read of the workers' PUSHED words
(workers.control), and every array step goes
through shm.gilkeep (decision 74: no numpy reduction, sort or unique here,
each of which may let the GIL go).
"""
import struct
import time

import numpy as np

from shm import gilkeep
from shm.ring import RECORD_DTYPE
from workers import status as st
from workers.records import KIND_PROBE

from .discovery import Discovery
from .index import StoreIndex
from .ledger import OpLedger
from .storescan import StoreScan

# RECORD_DTYPE's fields as a struct, the digest skipped: (op_id, host_page,
# io_ns, page_pos, kind, status, err); a drain up to SMALL_DRAIN_BYTES of
# records is unpacked with it (Draining.apply_small).
_RECORD = struct.Struct("<QqQIBBH32x")
assert _RECORD.size == RECORD_DTYPE.itemsize
SMALL_DRAIN_BYTES = 8 * RECORD_DTYPE.itemsize


class Draining:
    """Drains `pool`'s completion rings and `evictor`'s evict ring (None: no
    storage limits) into `ledger`, `discovery` and `index`; `control` is the
    workers' control block (their page counts)."""

    def __init__(self, ledger: OpLedger, discovery: Discovery, index: StoreIndex, pool, control,
                 evictor, scan: StoreScan):
        self.ledger, self.discovery, self.index = ledger, discovery, index
        self.pool, self.control, self.evictor = pool, control, evictor
        self.scan = scan
        # a worker whose completion ring is full waits for a drain: a lazy poll
        # drains from half a ring (every ring has the same capacity)
        self.half_ring = pool.workers[0].completion_ring.capacity // 2
        self._pushed = b""   # the PUSHED words at the last drain of the rings: none yet
        self._pushed_view = control.pushed_view()  # read on every poll

    def rings(self, batch_min: int) -> int:
        """Every worker's completion ring with something in it, then the evict
        ring (those pages are gone: the index forgets them); completions
        applied. `batch_min`: hicache_mp.engine.prefetch.BATCH_APPLY_MIN.

        The rings are popped first and their records applied as one drain
        (decision 87): a step of a loaded engine finds a page or two on each of
        a dozen rings, and the per-drain numpy steps below cost more than the
        pages. One worker's records stay in its order; one worker's after
        another's is a valid landed order, as they ran concurrently."""
        parts = []
        pushed = bytes(self._pushed_view)
        if pushed != self._pushed:
            # Most polls find nothing: one read of the PUSHED words tells them
            # (workers.control: Pushed), read before the rings are popped.
            self._pushed = pushed
            for handle in self.pool.workers:
                if not handle.rings_closed and handle.completion_ring.pending():
                    parts.append(handle.completion_ring.pop_bytes())
        n = 0
        if parts:
            raw = b"".join(parts)
            if len(raw) <= SMALL_DRAIN_BYTES and len(raw) < batch_min * RECORD_DTYPE.itemsize:
                n = self.apply_small(raw, batch_min)
            else:
                n = self.apply(np.frombuffer(raw, dtype=RECORD_DTYPE), batch_min)
        self.side_rings()
        return n

    def side_rings(self) -> None:
        """The rings no op waits on, also on a lazy poll that leaves the
        completion rings alone: the evict ring (those pages are gone, the
        index forgets them), then a share of the store scan's (the pages it
        listed join the index)."""
        evictor = self.evictor
        if evictor is not None and evictor.ring.pending():
            discard = self.index.discard  # (a scan running must not bring them back)
            for digest in evictor.pop()["digest"]:
                discard(digest.tobytes())
        self.scan.take()

    def quiet(self) -> bool:
        """Nothing for a poll to do here (the engine's fast path, without its
        lock): no completion pushed since the last pass over the rings, nothing
        on the evict ring, no store scan being taken into the index."""
        evictor = self.evictor
        return bytes(self._pushed_view) == self._pushed and not self.index.scanning and \
            (evictor is None or not evictor.ring.pending())

    def due(self) -> bool:
        """For poll(lazy=True) (decision 88): whether the rings may hold what a
        caller waits for, an op's last page or a probe answer, or are filling
        (the ledger's `may_finish`, waiters note 1)."""
        if self.discovery.waiting:
            return True
        return self.ledger.may_finish(self.control.pages_done, self.half_ring)

    def ring(self, ring, batch_min: int) -> int:
        """One completion ring, whole; the page completions applied."""
        return self.apply(np.frombuffer(ring.pop_bytes(), dtype=RECORD_DTYPE), batch_min)

    def apply_small(self, raw: bytes, batch_min: int) -> int:
        """A drain of a few records (a busy loop's usual one: a page or two),
        unpacked as tuples: numpy's per-call costs (frombuffer, the probe
        mask, a tolist per field) were most of a one-page drain (issue 45).
        Probes take the array path."""
        rows = list(_RECORD.iter_unpack(raw))
        for row in rows:
            if row[4] == KIND_PROBE:
                return self.apply(np.frombuffer(raw, dtype=RECORD_DTYPE), batch_min)
        self.ledger.settle_rows(rows, time.perf_counter_ns())
        return len(rows)

    def apply(self, recs, batch_min: int) -> int:
        """Completion records popped from the rings, in landed order; the page
        completions applied (their count)."""
        n = len(recs)
        if not n:
            return 0
        probes = gilkeep.eq(recs["kind"], KIND_PROBE)
        if gilkeep.any_(probes):
            # up to PROBE_MAX answers at once: chunked, so no numpy loop lets the GIL go
            answers = gilkeep.take(recs, gilkeep.where(probes))
            # the digests' bytes sliced from the contiguous records (one memcpy):
            # a strided field's tobytes() is a numpy copy loop that may let the GIL go
            raw, size = answers.tobytes(), answers.dtype.itemsize
            at = answers.dtype.fields["digest"][1]
            digests = b"".join([raw[o:o + 32] for o in range(at, len(raw), size)])
            hits = self.discovery.answered(digests,
                                           gilkeep.eq(answers["status"], st.OK).tolist())
            add = self.index.add_found
            for digest in hits:
                add(digest)
            recs = gilkeep.take(recs, gilkeep.where(gilkeep.eq(probes, False)))
            n = len(recs)
            if not n:
                return 0
        self.ledger.settle(recs, batch_min, time.perf_counter_ns())
        return n
