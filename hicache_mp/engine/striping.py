"""Striping: which worker gets which share of an op's pages or of a batch of probes.

Owns the 64-byte records handed to the workers (`records`), the round-robin
start that spreads consecutive ops and probe batches over the workers, and
the push of each share onto that worker's read or write ring with one wake
post per share. Must not settle pages: what a full ring refused comes back
to the caller (the engine ends those pages BUSY), and it never waits.

Runs on the scheduler's thread, so every array step goes through shm.gilkeep
(decision 74): numpy's copy and reduction loops over more than a few hundred
elements may let the GIL go, and each release costs the caller up to a
switch interval to win it back.
"""
import numpy as np

from shm import gilkeep
from shm.ring import RECORD_DTYPE
from workers import status as st
from workers.control import READS_SUBMITTED
from workers.pool import BrokenPool
from workers.records import KIND_PROBE, KIND_READ, KIND_WRITE

from .ops import READ, Op

# RECORD_DTYPE with the digest as one 32-byte field: a record's digest is then
# one element to numpy, not 32 (its copy loops count elements; shm.gilkeep).
_RECORD_V32 = np.dtype({"names": list(RECORD_DTYPE.names),
                        "formats": [RECORD_DTYPE.fields[k][0] if k != "digest" else "V32"
                                    for k in RECORD_DTYPE.names],
                        "offsets": [RECORD_DTYPE.fields[k][1] for k in RECORD_DTYPE.names],
                        "itemsize": RECORD_DTYPE.itemsize})


def records(digests: bytes, kind: int) -> np.ndarray:
    """Zeroed records of `kind` for 32-byte digests joined end to end."""
    n = len(digests) // 32
    recs = gilkeep.zeros(n, _RECORD_V32)
    gilkeep.assign(recs["digest"], np.frombuffer(digests, dtype="V32"))
    gilkeep.assign(recs["kind"], kind)
    return recs.view(RECORD_DTYPE)


class Striping:
    """The engine's one striper: `pool` and `control` are the engine's."""

    def __init__(self, pool, control):
        self.pool = pool
        self.control = control
        self.rr = 0  # where the next op's or probe batch's first record goes

    def submit(self, op: Op) -> list:
        """Hand `op`'s pending pages to the workers; the page positions a full
        ring refused (backpressure: the caller says so per page, never queues
        unbounded). Sets `op.worker_of`."""
        n = op.num_pages
        recs = records(op.digest_bytes, KIND_READ if op.kind == READ else KIND_WRITE)
        recs["op_id"] = op.id
        gilkeep.assign(recs["host_page"], op.host_pages)
        gilkeep.assign(recs["page_pos"], gilkeep.iota(n))
        if op.parts is not None:  # a READ's io_ns names its layer group (decision 101)
            gilkeep.assign(recs["io_ns"], op.parts)
        # Ready workers only; with none ready (all being replaced), pages wait in
        # the replacements' rings (workers.pool).
        workers = self.pool.usable() or self.pool.starting
        if not workers:
            raise BrokenPool("no worker can take work")
        nw = len(workers)
        # Stripe pages over workers, page j to worker (start + j) % nw, so every
        # worker walks its share in op order and the leading pages land first.
        start = self.rr % nw
        self.rr = (start + n) % nw
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
                pushed = handle.write_ring.push(share)
            else:
                # Counted before the push: a worker may finish a page before we
                # could count it after (workers.control: reads outstanding).
                counts = self.control.workers[handle.index]
                counts[READS_SUBMITTED] += np.uint64(len(share))
                pushed = handle.read_ring.push(share)
                counts[READS_SUBMITTED] -= np.uint64(len(share) - pushed)
            if pushed:
                handle.wake.post()
            if pushed < len(share):
                rejected.extend(share["page_pos"][pushed:].tolist())
        return rejected

    def probe(self, ask: list) -> list:
        """Hand probes for the digests `ask` to the ready workers, striped as
        pages are; the digests sent (a full ring: the rest are asked next time)."""
        workers = self.pool.usable()
        if not workers or not ask:
            return []
        recs = records(b"".join(ask), KIND_PROBE)
        gilkeep.assign(recs["host_page"], -1)
        nw = len(workers)
        sent = []
        for i in range(min(nw, len(ask))):
            handle = workers[(self.rr + i) % nw]
            pushed = handle.read_ring.push(recs[i::nw])
            if pushed:
                handle.wake.post()
                sent.extend(ask[i::nw][:pushed])
        self.rr = (self.rr + len(ask)) % nw
        return sent
