"""OpLedger: the engine's books, in one object.

Owns every piece of state that says where the engine's ops stand, and the
rules that change it:
  - the ops in flight and the next op id;
  - the host slots: `reserved` (an I/O may still write the slot; a killed
    stuck worker's slots stay fenced there, with their ops held not done,
    until it is gone) and `slot_op` (its op is not done);
  - the pins (a counting table by digest, workers.control: the evictor never
    removes a pinned page; the mp engine shares its control block's table);
  - the status counts per kind and the busy time per kind;
  - the engine-wide landed order (`seq`, Op.landed_seq) and the worker
    completions drained (`worker_pages`, the count a wake-up target is built
    on: hicache_mp.engine.waiters, note 1);
  - the backup budget's count of host pages held by backups in flight;
  - one log line per distinct cause.
Its rules: admit (an op's slots, pins and budget), apply (one page), apply_many
(many pages of one op, with numpy), settle (a drain's page completions, in
landed order), retire (a done op), fail a lost worker's pages, and fence a
killed worker's slots (its ops are not done until it is gone).

Must not pop rings, look at processes, sleep or take a lock: its callers
(EngineCore's calls, hicache_mp.engine.draining, hicache_mp.engine.supervisor,
hicache_mp.engine.closing, the in-process baselines) hold the engine's lock. It
touches the index only to keep it true (a page written is added, a read
miss heals it).

`apply_many` and `settle` run on the scheduler's thread over a drain's worth
of pages: every array step in shm.gilkeep (decision 74), and no method call
per page on the bulk path.
"""
import logging
import os

import numpy as np

from shm import gilkeep
from workers import status as st
from workers.control import PIN_SLOTS, pin_slots

from .index import StoreIndex
from .ops import READ, WRITE, Op

log = logging.getLogger("hicache_mp")
_IS_READ_MISS = np.zeros(256, dtype=bool)  # by status code: a read result that heals the index
_IS_READ_MISS[list(st.READ_MISSES)] = True
_IS_DAMAGED = np.zeros(256, dtype=bool)    # ... and its file is there but bad (index.py)
_IS_DAMAGED[list(st.READ_DAMAGED)] = True


class OpLedger:
    """The books of one engine with `host_pool_pages` slots; `index` is the
    engine's index of the store, kept true by completions."""

    def __init__(self, host_pool_pages: int, backup_budget: int, index: StoreIndex):
        self._index = index
        self._ops: dict[int, Op] = {}
        self._next_id = 1
        # A slot is busy while an I/O may still write it (`_reserved`, per page;
        # the supervisor also fences the slots of a stuck worker's pages there)
        # and while its op is not done (`_slot_op`: the op's id, until it retires).
        self._reserved = np.zeros(host_pool_pages, dtype=bool)
        self._slot_op = np.zeros(host_pool_pages, dtype=np.int64)
        self._pins = np.zeros(PIN_SLOTS, dtype=np.uint64)
        self._counts = {READ: np.zeros(len(st.NAMES), dtype=np.int64),
                        WRITE: np.zeros(len(st.NAMES), dtype=np.int64)}
        self._busy_ns = {READ: 0, WRITE: 0}
        self._busy_since = {READ: 0, WRITE: 0}
        self._in_flight = {READ: 0, WRITE: 0}
        self._write_pages = 0          # host pages held by backups in flight (the budget's count)
        self._backup_budget = backup_budget
        self._seq = 0                  # completions seen, in order (Op.landed_seq; may skip)
        # Worker completions drained (probes aside): what the workers' PAGES words
        # sum to once everything pushed is drained. Pages the engine settles
        # itself (cancelled, dropped, failed with a dead worker) count in _seq
        # only, so a wake-up target must not be built on _seq (control: WAKE_AT).
        self._worker_pages = 0
        self._logged_causes: set = set()
        # fence key (a killed worker's handle) -> [(op, positions)]: pages failed
        # while that process may still write their slots (fail_worker)
        self._fenced: dict = {}

    def share_pins(self, table: np.ndarray) -> None:
        """Count pins in `table` (the mp engine's control block, which the
        evictor reads) instead of a private one; before any op is admitted."""
        self._pins = table

    # --- what others read ------------------------------------------------------
    @property
    def seq(self) -> int:
        """Page outcomes applied so far: moves whenever any op advances
        (the DeviceLoader's one compare per poll, decision 83)."""
        return self._seq

    @property
    def worker_pages(self) -> int:
        """Worker completions drained (waiters note 1)."""
        return self._worker_pages

    @property
    def pins(self) -> np.ndarray:
        return self._pins

    def __len__(self) -> int:
        return len(self._ops)

    def ops(self) -> list:
        """The ops in flight, a copy (a caller may end them while it walks)."""
        return list(self._ops.values())

    def get(self, op_id: int):
        return self._ops.get(op_id)

    def may_finish(self, pages_done, half_ring: int) -> bool:
        """For poll(lazy=True) (decision 88): whether the rings may hold an op's
        last page, or are filling (`half_ring` pushed and not drained: a worker
        whose ring is full waits for a drain). `pages_done`: the workers' PAGES
        sum, a callable read only with ops in flight. A worker counts a page
        before it pushes it, so while fewer pages than any op's outstanding
        ones are pushed and not drained, no op can be done (waiters note 1)."""
        ops = self._ops
        if not ops:
            return True
        undrained = pages_done() - self._worker_pages
        if undrained <= 0:
            return False
        return undrained >= min(half_ring, min(op.pages_left for op in ops.values()))

    def metrics(self, now_ns: int, page_bytes: int) -> dict:
        out = {"ops_in_flight": len(self._ops), "pages_in_flight": int(self._reserved.sum())}
        for kind in (READ, WRITE):
            counts = self._counts[kind]
            busy = self._busy_ns[kind] + (now_ns - self._busy_since[kind]
                                          if self._in_flight[kind] else 0)
            nbytes = int(counts[st.OK]) * page_bytes
            out[f"{kind}_pages_ok"] = int(counts[st.OK])
            out[f"{kind}_bytes"] = nbytes
            out[f"{kind}_busy_s"] = busy / 1e9
            out[f"{kind}_gbps"] = nbytes / busy if busy else 0.0
            out[f"{kind}_status"] = {st.NAMES[i]: int(c) for i, c in enumerate(counts) if c}
        out["misses"] = int(sum(self._counts[READ][c] for c in st.READ_MISSES))
        return out

    def budget_metrics(self) -> dict:
        return {"backup_budget_pages": self._backup_budget,
                "backup_pages_held": self._write_pages}

    # --- an op in ------------------------------------------------------------
    def check_free(self, pages: np.ndarray) -> None:
        """ValueError if a slot of `pages` belongs to an op still in flight
        (or is fenced): an I/O may still write it."""
        if len(pages):
            busy = gilkeep.take(self._reserved, pages) | (gilkeep.take(self._slot_op, pages) != 0)
            if gilkeep.any_(busy):
                raise ValueError(f"host pages {pages[busy][:8].tolist()} belong to an op "
                                 f"still in flight")

    def new_id(self) -> int:
        op_id = self._next_id
        self._next_id += 1
        return op_id

    def admit(self, op: Op, now_ns: int) -> bool:
        """Take `op` (pages > 0, `digest_bytes` set) into the books: its slots
        reserved, its pages pinned (one vectorised add), a backup's pages
        counted against the budget, those over it ended DROPPED at once (the
        leading pages go: a write-back that cannot keep up is shed, never
        queued). False if that ended the op: nothing is left to submit."""
        kind, pages = op.kind, op.host_pages
        gilkeep.set_at(self._reserved, pages, True)
        gilkeep.set_at(self._slot_op, pages, op.id)
        self._ops[op.id] = op
        if self._in_flight[kind] == 0:
            self._busy_since[kind] = op.submit_ns
        self._in_flight[kind] += 1
        op.pin_slots = pin_slots(op.digest_bytes)
        op.pins_unique = not gilkeep.repeats(op.pin_slots)  # once: its drains skip it
        gilkeep.add_at(self._pins, op.pin_slots, 1, unique=op.pins_unique)
        if kind == WRITE:
            room = max(0, self._backup_budget - self._write_pages)
            self._write_pages += op.num_pages
            if room < op.num_pages:
                for pos in range(room, op.num_pages):  # the tail; the leading pages go
                    self.apply(op, pos, st.DROPPED, 0, 0, now_ns)
                if op.done:
                    return False
        return True

    # --- outcomes --------------------------------------------------------------
    def settle(self, recs, batch_min: int, now: int) -> None:
        """A drain's page completions (records, probes already taken out), in
        landed order: numbered in the engine-wide order and counted as worker
        completions; per op, in bulk (`apply_many`) from `batch_min` pages
        (hicache_mp.engine.prefetch.BATCH_APPLY_MIN), else page by page."""
        n = len(recs)
        # One worker's completions in the order it did them: that order is the
        # engine-wide landed order (Op.landed_seq), also across ops.
        seq0 = self._seq
        self._seq += n
        self._worker_pages += n  # what a wake-up target counts (hicache_mp.engine.waiters, note 1)
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
            op = self._ops.get(int(op_id))
            if op is not None:
                seqs = gilkeep.iota(n, seq0) if at is None else seq0 + at
                self.apply_many(op, part["page_pos"], part["status"], part["io_ns"],
                                part["err"], seqs, now)

    def settle_rows(self, rows, now: int) -> None:
        """`settle` of a few page completions as tuples (op_id, host_page,
        io_ns, page_pos, kind, status, err), in landed order, page by page
        (a drain this small is under every `batch_min`)."""
        seq = self._seq
        self._seq += len(rows)
        self._worker_pages += len(rows)   # hicache_mp.engine.waiters, note 1
        ops, apply = self._ops, self.apply
        for op_id, _, io_ns, pos, _, code, err in rows:
            op = ops.get(op_id)
            if op is not None:
                apply(op, pos, code, io_ns, err, now, seq)
            seq += 1

    def _each(self, recs, seqs, now: int) -> None:
        ops, apply = self._ops, self.apply
        for op_id, pos, code, io_ns, err, seq in zip(
                recs["op_id"].tolist(), recs["page_pos"].tolist(), recs["status"].tolist(),
                recs["io_ns"].tolist(), recs["err"].tolist(), seqs):
            op = ops.get(op_id)
            if op is not None:
                apply(op, pos, code, io_ns, err, now, seq)

    def apply(self, op: Op, pos: int, code: int, io_ns: int, err: int, now_ns: int,
              seq: int | None = None, held: bool = False) -> None:
        """Feed one page's outcome to its op; retire the op when it is done.
        `seq`: its place in the landed order, when the caller numbered a batch.
        `held`: a fenced page (fail_worker): its slot stays reserved and its op
        not done until unfence."""
        if op.page_status[pos] != st.PENDING:
            return
        if not held:
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
        if held:
            op.hold_failed(pos, code, now_ns)
        elif op.record_page(pos, code, io_ns, now_ns):
            self.retire(op, now_ns)

    def apply_many(self, op: Op, pos, codes, io_ns, errs, seqs, now_ns: int) -> None:
        """`apply` for many pages of one op at once (numpy arrays; a page at most
        once); `seqs` are their places in the engine-wide completion order.

        What `poll()` pays per drained completion: a scheduler that polls once
        per step (SGLang does) drains a step's worth of pages together. On the
        2-core CI box, 4096 completions in one poll: 4.3 µs each through
        `apply`, 1.1 µs each here. Its numpy calls have a fixed cost, so small
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
        if op.record_pages(pos, codes, gilkeep.total(io_ns), now_ns):
            self.retire(op, now_ns)

    def retire(self, op: Op, now_ns: int) -> None:
        """A done op leaves the books: its slots are free for the next op."""
        slots = op.host_pages
        mine = gilkeep.eq(gilkeep.take(self._slot_op, slots), op.id)
        gilkeep.set_at(self._slot_op, slots[mine], 0)
        self._ops.pop(op.id, None)
        self._in_flight[op.kind] -= 1
        if self._in_flight[op.kind] == 0:
            self._busy_ns[op.kind] += now_ns - self._busy_since[op.kind]

    # --- lost workers ------------------------------------------------------------
    def fail_worker(self, index: int, now_ns: int, fence=None) -> np.ndarray:
        """End every page still pending at worker `index` WORKER_DIED; returns
        their host slots.

        `fence`: a key (the killed process's handle) when that worker may still
        write the slots: a stuck worker killed in a page I/O. Then the pages'
        status is final at once, but their slots stay reserved and their ops
        not done (op.done means the slots may be reused) until unfence(key),
        once the process is gone. A page failed here is never written into its
        slot later, whatever the kernel finishes meanwhile."""
        slots = []
        for op in list(self._ops.values()):
            lost = np.flatnonzero((op.worker_of == index) & (op.page_status == st.PENDING))
            if not len(lost):
                continue
            slots.append(op.host_pages[lost])
            for pos in lost.tolist():
                self.apply(op, pos, st.WORKER_DIED, 0, 0, now_ns, held=fence is not None)
            if fence is not None:
                self._fenced.setdefault(fence, []).append((op, lost))
        return np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)

    def unfence(self, fence, now_ns: int) -> int:
        """The process behind `fence` is gone: its failed pages' slots are free,
        and their ops done if nothing else is left. Returns the pages released."""
        n = 0
        for op, pos in self._fenced.pop(fence, ()):
            gilkeep.set_at(self._reserved, gilkeep.take(op.host_pages, pos), False)
            n += len(pos)
            if op.release_held(len(pos), now_ns):
                self.retire(op, now_ns)
        return n

    def unfence_all(self, now_ns: int) -> int:
        """Every fence lifted: close(), once the I/O is shut down."""
        return sum(self.unfence(key, now_ns) for key in list(self._fenced))

    @property
    def fenced_pages(self) -> int:
        """Pages whose slots wait for a killed worker to be gone."""
        return sum(len(pos) for entries in self._fenced.values() for _, pos in entries)

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
        if code == st.DENIED:
            # the page's path is a digest nobody recognises: name the store's
            # directories and the fix (the start warning, workers.store
            # .write_problem, says whose and which mode)
            detail += (f" writing into {', '.join(self._index.store.roots)}: this uid "
                       f"({os.getuid()}) may not write there; chown it, share it by a setgid "
                       f"group (docs/operations.md), or run as its owner")
        log.warning("hicache_mp %s: %s%s; later pages with this cause are counted in "
                    "metrics(), not logged", kind, st.NAMES[code], detail)
