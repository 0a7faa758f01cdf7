"""Draining: the workers' completion rings and the evict ring into the engine's books.

Owns popping each ring, telling probe answers (to discovery and the index)
from page completions, numbering completions in the engine-wide landed order,
and choosing, per op of a drain, the bulk path (EngineCore._apply_many) or
page by page (EngineCore._apply). Must not decide what a completion means
for an op or a slot: `_apply` / `_apply_many` do; nor look at processes
(hicache_mp.supervisor).

Runs inside poll() on the scheduler's thread: a poll that finds nothing costs
a load per ring, and every array step goes through shm.gilkeep (decision 74:
no numpy reduction, sort or unique here, each of which may let the GIL go).
"""
import time

import numpy as np

from shm import gilkeep
from shm.ring import RECORD_DTYPE
from workers import status as st
from workers.records import KIND_PROBE


class Draining:
    """Drains for `core`, the EngineCore whose ops, index, discovery and
    counters the completions go to."""

    def __init__(self, core):
        self.core = core

    def rings(self, pool, evictor, batch_min: int) -> int:
        """Every worker's completion ring with something in it, then the evict
        ring (those pages are gone: the index forgets them); completions
        applied. `batch_min`: hicache_mp.engine.BATCH_APPLY_MIN.

        The rings are popped first and their records applied as one drain
        (decision 87): a step of a loaded engine finds a page or two on each of
        a dozen rings, and the per-drain numpy steps below cost more than the
        pages. One worker's records stay in its order; one worker's after
        another's is a valid landed order, as they ran concurrently."""
        parts = []
        for handle in pool.workers:
            # Most polls find nothing: keep them to a load each.
            if not handle.rings_closed and handle.completion_ring.pending():
                parts.append(handle.completion_ring.pop_bytes())
        n = 0
        if parts:
            n = self.apply(np.frombuffer(b"".join(parts), dtype=RECORD_DTYPE), batch_min)
        self.evicted(evictor)
        return n

    def evicted(self, evictor) -> None:
        """The evict ring: those pages are gone, the index forgets them."""
        if evictor is not None and evictor.ring.pending():
            discard = self.core._index.digests.discard
            for digest in evictor.pop()["digest"]:
                discard(digest.tobytes())

    def due(self, pool, control) -> bool:
        """For poll(lazy=True) (decision 88): whether the rings may hold what a
        caller waits for, an op's last page or a probe answer, or are filling.
        A worker counts a page in its PAGES word before it pushes it, so while
        fewer pages than any op's outstanding ones are pushed and not drained,
        no op can be done (waiters note 1)."""
        core = self.core
        if core._discovery.waiting or not core._ops:
            return True
        undrained = control.pages_done() - core._worker_pages
        if undrained <= 0:
            return False
        # half a ring: a worker whose ring is full waits for a drain
        least = min(pool.workers[0].completion_ring.capacity // 2,
                    min(op._remaining for op in core._ops.values()))
        return undrained >= least

    def ring(self, ring, batch_min: int) -> int:
        """One completion ring, whole; the page completions applied."""
        return self.apply(np.frombuffer(ring.pop_bytes(), dtype=RECORD_DTYPE), batch_min)

    def apply(self, recs, batch_min: int) -> int:
        """Completion records popped from the rings, in landed order; the page
        completions applied (their count)."""
        core = self.core
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
            hits = core._discovery.answered(digests,
                                            gilkeep.eq(answers["status"], st.OK).tolist())
            add = core._index.add_found
            for digest in hits:
                add(digest)
            recs = gilkeep.take(recs, gilkeep.where(gilkeep.eq(probes, False)))
            n = len(recs)
            if not n:
                return 0
        now = time.perf_counter_ns()
        # One worker's completions in the order it did them: that order is the
        # engine-wide landed order (Op.landed_seq), also across ops.
        seq0 = core._seq
        core._seq += n
        core._worker_pages += n  # what a wake-up target counts (hicache_mp.waiters, note 1)
        op_ids = recs["op_id"]
        if n < batch_min:
            groups = [(None, None)]
        elif gilkeep.all_(gilkeep.eq(op_ids, op_ids[0])):
            groups = [(op_ids[0], None)]
        else:
            # dict, not np.unique: a sort lets the GIL go (shm.gilkeep)
            groups = [(i, gilkeep.where(gilkeep.eq(op_ids, i)))
                      for i in dict.fromkeys(op_ids.tolist())]
        for op_id, at in groups:
            part = recs if at is None else recs[at]
            if op_id is None or len(part) < batch_min:
                seqs = range(seq0, seq0 + n) if at is None else (seq0 + at).tolist()
                self._each(part, seqs, now)
                continue
            op = core._ops.get(int(op_id))
            if op is not None:
                seqs = gilkeep.iota(n, seq0) if at is None else seq0 + at
                core._apply_many(op, part["page_pos"], part["status"], part["io_ns"],
                                 part["err"], seqs, now)
        return n

    def _each(self, recs, seqs, now: int) -> None:
        core = self.core
        ops = core._ops
        for op_id, pos, code, io_ns, err, seq in zip(
                recs["op_id"].tolist(), recs["page_pos"].tolist(), recs["status"].tolist(),
                recs["io_ns"].tolist(), recs["err"].tolist(), seqs):
            op = ops.get(op_id)
            if op is not None:
                core._apply(op, pos, code, io_ns, err, now, seq)
