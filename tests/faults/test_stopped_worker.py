"""A worker that takes no work (SIGSTOP stands for a descheduled or swapped-out
process, or one held in a debugger) while reads are queued to it must not hold
back the other workers' backups (issue 23, bug 2).

Reads first across workers defers a write while any worker has reads
outstanding; a worker that makes no progress is left out of that count
(workers.writesched), so the backups on the healthy workers go at full
speed: before, each waited WRITE_DEFER_MAX_S (0.5 s), 4 pages took 2 s.

Reaches inside: the engine's `_pool` (its usable() workers, in the order
work is striped over them: the test predicts which worker each one-page op
goes to, so no backup page lands on the stopped one; no public call gives
the striping order).
"""
import os
import signal
import time

from workers.pagefile import HEADER_SIZE

from faultkit import MID, backup, content, fingerprint, make, page_file, poison, put, stop_when, \
    wrong_pages

NUM_WORKERS = 3
NUM_WRITES = 8


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in "Tt"


def test_backups_on_healthy_workers_go_at_full_speed_beside_a_stopped_one(store):
    with make(store, geo=MID, pages=64, workers=NUM_WORKERS) as e:
        pb = e.geometry.page_bytes
        old = [f"old-{i}" for i in range(12)]
        backup(e, old, range(12))
        victim, pid = 0, e.worker_pids()[0]
        order = [h.index for h in e._pool.usable()]
        assert len(order) == NUM_WORKERS and victim in order
        os.kill(pid, signal.SIGSTOP)
        try:
            assert stop_when(pid, lambda: _stopped(pid), 5.0), "never stopped"
            free = iter(range(12, 64))

            def read(keys):
                slots = [next(free) for _ in keys]
                poison(e, slots)
                return e.prefetch(keys, slots)

            # Striped over every worker: the victim's share stays queued.
            reads = [read(old[:6])]
            assert (reads[0].worker_of == victim).sum() == 2
            wkeys = [f"new-{i}" for i in range(NUM_WRITES)]
            wslots = [next(free) for _ in wkeys]
            for k, s in zip(wkeys, wslots):
                put(e, s, content(k, pb))
            # One-page ops, so no backup page goes to the victim: a page that
            # would is a read instead (another read queued at the stopped worker).
            last, writes = int(reads[0].worker_of[-1]), []
            t0 = time.monotonic()
            while len(writes) < NUM_WRITES:
                nxt = order[(order.index(last) + 1) % len(order)]
                if nxt == victim:
                    op = read([old[len(reads) % len(old)]])
                    reads.append(op)
                else:
                    i = len(writes)
                    op = e.backup([wkeys[i]], [wslots[i]])
                    writes.append(op)
                assert int(op.worker_of[0]) == nxt, (op.worker_of, nxt)
                last = nxt
            for op in writes:
                assert e.wait(op, 10), f"a backup hung beside a stopped worker: {op}"
            took = time.monotonic() - t0
            assert [op.status for op in writes] == ["ok"] * NUM_WRITES
            assert took < 0.5, f"{NUM_WRITES} pages took {took:.2f} s beside a stopped worker"
            # The victim really held its reads all along.
            assert not any(op.done for op in reads)
            assert _stopped(pid)
        finally:
            os.kill(pid, signal.SIGCONT)
        for op in reads:
            assert e.wait(op, 30) and op.status == "ok", op
            assert not wrong_pages(e, op, lambda k: {fingerprint(content(k, pb))})
        assert e.metrics()["stuck_workers"] == 0
        # Bytes on disk: each page file holds exactly what was backed up.
        for k in wkeys:
            with open(page_file(e, k), "rb") as f:
                data = f.read()
            assert len(data) == HEADER_SIZE + pb and data[HEADER_SIZE:] == content(k, pb), k
