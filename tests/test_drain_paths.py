"""poll() has two ways to account for drained completions: page by page
(`OpLedger.apply`, small drains) and in bulk (`apply_many`, drains of at
least `BATCH_APPLY_MIN`). Whatever the path, a user must see the same thing:
bytes, per-page statuses, leading pages, metrics, the index healed after a
miss or a damaged file, written pages findable, and landed order kept.

A poll that finds no worker's PUSHED word moved since its last drain reads
no ring (workers.control: Pushed); poll() alone, never a wait, still drains
every completion, and each worker has rung once per completion it pushed.

Reaches inside: the engine's `_control` (its pin table: two keys that share a
pin slot count 2 there while in flight and 0 after, drained in bulk or page
by page; the pins are the evictor's, and no public call shows them; its
PUSHED words, the workers' count of completions pushed, which no public
call shows either).
"""
import os
import sys
import time

import numpy as np
import pytest

import hicache_mp.engine.prefetch as engine_mod

from faultkit import MID, content, fingerprint, get, make, page_file, put, \
    workers_counted  # noqa: E402


def _run(store, monkeypatch, batch_min):
    monkeypatch.setattr(engine_mod, "BATCH_APPLY_MIN", batch_min)
    with make(store, geo=MID, pages=160, workers=2, write_checksum=True) as e:
        pb = e.geometry.page_bytes
        keys = [f"k{i}" for i in range(64)]
        for i, k in enumerate(keys):
            put(e, i, content(k, pb))
        # Let each op finish before polling, so a drain holds many completions.
        wop = e.backup(keys, range(64))
        workers_counted(e, 64)
        assert e.wait(wop, 30) and wop.status == "ok"
        assert e.exists(keys) == 64  # written pages are indexed
        os.unlink(page_file(e, keys[10]))           # a miss in the middle
        with open(page_file(e, keys[20]), "r+b") as f:  # a damaged payload byte
            f.seek(4096 + 7)
            b = f.read(1)
            f.seek(4096 + 7)
            f.write(bytes([b[0] ^ 0xFF]))
        rop = e.prefetch(keys, range(64, 128))
        workers_counted(e, 128)
        assert e.wait(rop, 30)
        got = [fingerprint(get(e, 64 + i)) if s == 1 else None
               for i, s in enumerate(rop.page_status.tolist())]
        m = e.metrics()
        return {
            "read_status": rop.page_status.tolist(), "write_status": wop.page_status.tolist(),
            "completed": rop.completed_pages, "status": rop.status, "ok_pages": rop.ok_pages,
            "bytes": got, "want": [fingerprint(content(k, pb)) for k in keys],
            "counts": (m["read_status"], m["write_status"], m["misses"]),
            "exists_after": e.exists(keys), "landed_orders": (
                np.argsort(wop.landed_seq).tolist(), np.argsort(rop.landed_seq).tolist()),
            "seq_unique": len(set(rop.landed_seq.tolist()) | set(wop.landed_seq.tolist())),
            "held": m["backup_pages_held"],
        }


def test_bulk_and_per_page_accounting_agree(tmp_path, monkeypatch):
    bulk = _run(str(tmp_path / "bulk"), monkeypatch, 1)
    one = _run(str(tmp_path / "one"), monkeypatch, 10 ** 9)
    for r in (bulk, one):
        assert r["completed"] == 10 and r["status"] == "partial" and r["ok_pages"] == 62
        assert r["read_status"][10] == 2 and r["read_status"][20] == 3  # miss, corrupt
        assert all(g == w for g, w in zip(r["bytes"], r["want"]) if g is not None)
        assert r["exists_after"] == 10  # the index forgot the missing and the damaged page
        assert r["seq_unique"] == 128 and r["held"] == 0
    for key in ("read_status", "write_status", "counts", "bytes"):
        assert bulk[key] == one[key], key
    # One worker's pages land in the order it did them on either path: page i
    # goes to worker i % 2, which does its share in op order.
    for r in (bulk, one):
        for order in r["landed_orders"]:
            for w in (0, 1):
                mine = [p for p in order if p % 2 == w]
                assert mine == sorted(mine)


@pytest.mark.parametrize("batch_min", [1, 10 ** 9])
def test_a_backup_budget_is_given_back_on_either_path(store, monkeypatch, batch_min):
    monkeypatch.setattr(engine_mod, "BATCH_APPLY_MIN", batch_min)
    with make(store, geo=MID, pages=64, workers=2, backup_budget_pages=32) as e:
        pb = e.geometry.page_bytes
        for i in range(32):
            put(e, i, content(f"b{i}", pb))
        op = e.backup([f"b{i}" for i in range(32)], range(32))
        workers_counted(e, 32)
        assert e.wait(op, 30) and op.status == "ok"
        assert e.metrics()["backup_pages_held"] == 0
        again = e.backup([f"c{i}" for i in range(32)], range(32))  # room again: not dropped
        assert e.wait(again, 30) and again.status == "ok"


@pytest.mark.parametrize("batch_min", [1, 10 ** 9])
def test_keys_sharing_a_pin_slot_are_unpinned_on_either_path(store, monkeypatch, batch_min):
    """Two keys whose digests fall in one pin-table slot, in one op with
    others: the slot is pinned twice while they are in flight, and every pin
    is gone once the op is done (a pin left behind keeps a page from
    eviction for good). Drains of such an op count the slot per page."""
    from workers import naming
    from workers.control import pin_slot
    monkeypatch.setattr(engine_mod, "BATCH_APPLY_MIN", batch_min)
    with make(store, geo=MID, pages=128, workers=2) as e:
        seen, pair = {}, None
        for i in range(100000):
            k = f"p{i}"
            slot = pin_slot(naming.key_digest(k, e.namespace))
            if slot in seen:
                pair = [seen[slot], k]
                break
            seen[slot] = k
        keys = pair + [f"q{i}" for i in range(30)]
        pb = e.geometry.page_bytes
        for i, k in enumerate(keys):
            put(e, i, content(k, pb))
        wop = e.backup(keys, range(len(keys)))
        assert e._control.pins[pin_slot(naming.key_digest(pair[0], e.namespace))] == 2
        workers_counted(e, len(keys))
        assert e.wait(wop, 30) and wop.status == "ok"
        rop = e.prefetch(keys, range(64, 64 + len(keys)))
        workers_counted(e, 2 * len(keys))
        assert e.wait(rop, 30) and rop.status == "ok"
        assert int(np.count_nonzero(e._control.pins)) == 0
        assert [fingerprint(get(e, 64 + i)) for i in range(len(keys))] == \
            [fingerprint(content(k, pb)) for k in keys]


def test_poll_alone_drains_every_completion_the_workers_rang_for(store):
    """Busy polls with no wait: every page of a backup and of a prefetch lands
    through poll() (a worker that pushed and did not ring, or a poll that
    skipped a moved word, leaves an op unfinished here for good), and the
    workers' PUSHED words sum to the completions they pushed."""
    with make(store, geo=MID, pages=96, workers=2) as e:
        pb, n = e.geometry.page_bytes, 40
        keys = [f"r{i}" for i in range(n)]
        for i, k in enumerate(keys):
            put(e, i, content(k, pb))

        def polled(op):
            deadline = time.monotonic() + 30
            while not op.done:
                e.poll()
                assert time.monotonic() < deadline, op.status_counts()
            return op.status

        assert polled(e.backup(keys, range(n))) == "ok"
        assert int(e._control.pushed[:2].sum()) == n
        assert polled(e.prefetch(keys, range(n, 2 * n))) == "ok"
        assert int(e._control.pushed[:2].sum()) == 2 * n
        assert e.poll() == 0   # nothing new was pushed: nothing drained
        assert [fingerprint(get(e, n + i)) for i in range(n)] == \
            [fingerprint(content(k, pb)) for k in keys]


def test_bench_poll_in_flight_times_every_poll():
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_poll.py"),
                           "--in-flight", "4", "--workers", "1", "--pages", "16",
                           "--page-kib", "64", "--rounds", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    # at least the poll that drained the last pages (one drain may take them all)
    assert float(rows["all"][2]) > 0 and int(rows["all"][1]) >= 1, proc.stdout
    assert "drained some" in proc.stdout   # some poll drained the pages
    assert "target: median <= 2" in proc.stdout


def test_bench_poll_runs_and_prints_the_ratio():
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_poll.py"),
                           "--sizes", "8", "128", "--repeats", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["8"], ["128"])]
    assert len(rows) == 2 and all(len(r) == 5 and float(r[4]) > 0 for r in rows), proc.stdout
