"""Ring: a million records across processes, none lost, duplicated or reordered."""
import subprocess
import sys
import textwrap
import time

import numpy as np

from shm import Ring, RECORD_DTYPE, new_owner_tag

PRODUCER = textwrap.dedent("""
    import sys, time, numpy as np
    from shm import Ring, RECORD_DTYPE
    ring = Ring(sys.argv[1], int(sys.argv[2]), create=False)
    total, batch = int(sys.argv[3]), 257  # odd batch: exercises wrap-around
    sent = 0
    buf = np.zeros(batch, dtype=RECORD_DTYPE)
    while sent < total:
        n = min(batch, total - sent)
        buf["op_id"][:n] = np.arange(sent, sent + n)
        buf["host_page"][:n] = -np.arange(sent, sent + n)
        buf["digest"][:n, 0] = np.arange(sent, sent + n) % 251
        pushed = ring.push(buf[:n])
        sent += pushed
        if pushed < n:
            time.sleep(0)
    ring.close()
""")


def test_million_records_between_processes():
    total, cap = 1_000_000, 1024
    ring = Ring(new_owner_tag() + ".ringtest", cap, create=True)
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, ring.name, str(cap), str(total)])
    try:
        expected = 0
        deadline = time.monotonic() + 120
        while expected < total:
            recs = ring.pop(500)
            if len(recs) == 0:
                assert proc.poll() in (None, 0), "producer died"
                assert time.monotonic() < deadline, f"stalled at {expected}"
                continue
            ids = recs["op_id"].astype(np.int64)
            want = np.arange(expected, expected + len(recs))
            assert np.array_equal(ids, want), f"lost/duplicated/reordered near {expected}"
            assert np.array_equal(recs["host_page"], -want)
            assert np.array_equal(recs["digest"][:, 0], want % 251)
            expected += len(recs)
        assert proc.wait(30) == 0
        assert len(ring.pop()) == 0, "records beyond the total"
    finally:
        proc.kill()
        proc.wait()
        ring.close()


def test_full_ring_reports_backpressure_without_blocking():
    ring = Ring(new_owner_tag() + ".full", 8, create=True)
    try:
        recs = np.zeros(5, dtype=RECORD_DTYPE)
        recs["op_id"] = np.arange(5)
        assert ring.push(recs) == 5
        t0 = time.perf_counter()
        assert ring.push(recs) == 3      # only what fits
        assert ring.push(recs) == 0      # full: says so at once
        assert time.perf_counter() - t0 < 0.5
        assert ring.depth() == 8 and ring.free() == 0
        out = ring.pop()
        assert out["op_id"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
        assert ring.push(recs) == 5      # space again after the consumer drained
    finally:
        ring.close()
