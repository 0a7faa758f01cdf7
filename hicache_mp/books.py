"""The books: each page's outcome applied to its op, and what that frees.

Owns what one completion does to the engine's state: the op's page status
and landed order, the host slot's reservation, the pin, the backup budget's
count, the status counters, the index (a written page added, a read miss
healed), one log line per distinct cause, and retiring a done op. Must not
pop rings or know where a completion came from (hicache_mp.draining, the
in-process baselines, close() and the supervisor call it).

`Books` is a mixin of EngineCore, whose `__init__` makes the state it keeps.
`_apply_many` runs on the scheduler's thread over a drain's worth of pages:
every array step in shm.gilkeep (decision 74).
"""
import logging
import os

import numpy as np

from shm import gilkeep
from workers import status as st

from .ops import READ, WRITE, Op

log = logging.getLogger("hicache_mp")
_IS_READ_MISS = np.zeros(256, dtype=bool)  # by status code: a read result that heals the index
_IS_READ_MISS[list(st.READ_MISSES)] = True
_IS_DAMAGED = np.zeros(256, dtype=bool)    # ... and its file is there but bad (index.py)
_IS_DAMAGED[list(st.READ_DAMAGED)] = True


class Books:
    """EngineCore's completion bookkeeping."""

    def _apply(self, op: Op, pos: int, code: int, io_ns: int, err: int, now_ns: int,
               seq: int | None = None) -> None:
        """Feed one page's outcome to its op; retire the op when it is done.
        `seq`: its place in the landed order, when the caller numbered a batch."""
        if op.page_status[pos] != st.PENDING:
            return
        self._reserved[op.host_pages[pos]] = False
        self._pins[op.pin_slots[pos]] -= 1
        if op.kind == WRITE:
            self._write_pages -= 1
        if seq is None:
            seq = self._seq
            self._seq += 1
        op.landed_seq[pos] = seq
        self._counts[op.kind][code] += 1
        if code == st.OK:
            if op.kind == WRITE:
                self._index.add(op.digests[pos])
        else:
            if op.kind == READ and code in st.READ_MISSES:
                # the index was stale: heal it
                self._index.discard(op.digests[pos], damaged=code in st.READ_DAMAGED)
            self._log_cause(op.kind, code, err)
        if op._complete(pos, code, io_ns, now_ns):
            self._retire(op, now_ns)

    def _apply_many(self, op: Op, pos, codes, io_ns, errs, seqs, now_ns: int) -> None:
        """`_apply` for many pages of one op at once (numpy arrays; a page at most
        once); `seqs` are their places in the engine-wide completion order.

        What `poll()` pays per drained completion: a scheduler that polls once
        per step (SGLang does) drains a step's worth of pages together. On the
        2-core CI box, 4096 completions in one poll: 4.3 µs each through
        `_apply`, 1.1 µs each here. Its numpy calls have a fixed cost, so small
        drains keep the scalar path (engine.BATCH_APPLY_MIN).
        """
        # contiguous: fancy stores from a record field's strided view may loop
        # with the GIL released (shm.gilkeep)
        pos = pos.astype(np.intp)
        codes, io_ns, errs = (np.ascontiguousarray(a) for a in (codes, io_ns, errs))
        # pages failed by a worker death stay failed
        live = gilkeep.eq(gilkeep.take(op.page_status, pos), st.PENDING)
        if not gilkeep.all_(live):
            pos, codes, io_ns, errs, seqs = pos[live], codes[live], io_ns[live], errs[live], \
                seqs[live]
        n = len(pos)
        if not n:
            return
        gilkeep.set_at(self._reserved, gilkeep.take(op.host_pages, pos), False)
        gilkeep.add_at(self._pins, gilkeep.take(op.pin_slots, pos), -1, unique=op.pins_unique)
        if op.kind == WRITE:
            self._write_pages -= n
        op.landed_seq[pos] = seqs
        ok = gilkeep.eq(codes, st.OK)
        every_ok = gilkeep.all_(ok)
        if every_ok:  # the common drain: one count, not add_at's Counter
            self._counts[op.kind][st.OK] += n
        else:
            gilkeep.add_at(self._counts[op.kind], codes, 1)
        digests = op.digests
        if op.kind == WRITE and (every_ok or gilkeep.any_(ok)):
            add = self._index.add
            for p in (pos if every_ok else pos[ok]).tolist():
                add(digests[p])
        if not every_ok:
            bad = ~ok
            if op.kind == READ:
                discard = self._index.discard  # the index was stale: heal it
                for p, code in zip(pos[bad & _IS_READ_MISS[codes]].tolist(),
                                   codes[bad & _IS_READ_MISS[codes]].tolist()):
                    discard(digests[p], damaged=bool(_IS_DAMAGED[code]))
            for code, err in set(zip(codes[bad].tolist(), errs[bad].tolist())):
                self._log_cause(op.kind, code, err)
        if op._complete_many(pos, codes, gilkeep.total(io_ns), now_ns):
            self._retire(op, now_ns)

    def _retire(self, op: Op, now_ns: int) -> None:
        slots = op.host_pages
        mine = gilkeep.eq(gilkeep.take(self._slot_op, slots), op.id)
        gilkeep.set_at(self._slot_op, slots[mine], 0)
        self._ops.pop(op.id, None)
        self._in_flight[op.kind] -= 1
        if self._in_flight[op.kind] == 0:
            self._busy_ns[op.kind] += now_ns - self._busy_since[op.kind]

    def _log_cause(self, kind: str, code: int, err: int) -> None:
        """One log line per distinct cause, not one per page."""
        if code in (st.MISS, st.CANCELLED, st.WORKER_DIED):  # deaths are logged by the engine
            return
        cause = (kind, code, err)
        if cause in self._logged_causes:
            return
        self._logged_causes.add(cause)
        if code == st.DROPPED:  # two causes: the backup budget (errno 0), storage limits (ENOSPC)
            detail = (f" ({os.strerror(err)}: over the storage limits)" if err else
                      f" (over backup_budget_pages={self._backup_budget})")
        else:
            detail = f" ({os.strerror(err)})" if err else ""
        log.warning("hicache_mp %s: %s%s; later pages with this cause are counted in "
                    "metrics(), not logged", kind, st.NAMES[code], detail)
