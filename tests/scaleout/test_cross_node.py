"""Pages across two JuiceFS mounts of one volume (two nodes, one store).

Each test puts its store on the volume and runs node A's engine on one
mount, node B's on the other: two FUSE clients with their own caches, agreeing
only through JuiceFS's metadata engine, as two machines would.
"""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import sharenode
from faultkit import BIG, MID, content, fingerprint, get, make, prefetch, put, settle, \
    stop_during_io, store_files, wrong_pages
from workers import directio, naming
from workers import status as st

HERE = os.path.dirname(os.path.abspath(__file__))


def _allowed(eng, writers=(0,), versions=(0,)):
    pb = eng.geometry.page_bytes
    return lambda k: {fingerprint(content(k, pb, w, v)) for w in writers for v in versions}


def _backup(eng, keys, slots, writer=0, version=0):
    for k, s in zip(keys, slots):
        put(eng, s, content(k, eng.geometry.page_bytes, writer, version))
    op = eng.backup(keys, slots)
    assert eng.wait(op, 60), op
    return op


def test_pages_written_on_one_node_read_byte_exact_on_the_other(nodes):
    keys = [f"x{i}" for i in range(48)]
    with make(nodes.a, geo=MID, pages=64) as a:
        assert _backup(a, keys, range(48)).status == "ok"
        with make(nodes.b, geo=MID, pages=64) as b:
            assert b.exists(keys) == len(keys)  # B's start-up scan, through its own mount
            got = prefetch(b, keys, range(48))
            assert got.status == "ok" and not wrong_pages(b, got, _allowed(b))
            # ...and the other way round, over pages A has read: B replaces them.
            # A's kernel may still map each name to the inode B's rename replaced
            # (JuiceFS --entry-cache, 1 s): a clean miss, never the old bytes torn.
            assert _backup(b, keys[:8], range(8), writer=1).status == "ok"
            first = prefetch(a, keys[:8], range(48, 56))
            assert set(first.status_counts()) <= {"ok", "miss"}, first.status_counts()
            assert not wrong_pages(a, first, _allowed(a, writers=(0, 1)))
            deadline = time.monotonic() + 5
            while True:
                again = prefetch(a, keys[:8], range(48, 56))
                if again.status == "ok" or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert again.status == "ok", again.status_counts()
            assert [get(a, 48 + i) for i in range(8)] == \
                [content(k, a.geometry.page_bytes, 1) for k in keys[:8]]


def test_both_nodes_write_the_same_keys_each_read_is_one_whole_version(nodes):
    """sharenode's two engines, each on its own mount: overlapping keys written
    by both, round after round, while each reads the other's; every read is a
    miss or byte-identical to one writer's one round."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=sharenode.run, args=(nodes.a, 0, "page_first", 0.0, barrier, out)),
             ctx.Process(target=sharenode.run, args=(nodes.b, 1, "layer_first", 0.2, barrier, out))]
    for p in procs:
        p.start()
    reports = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
    for r in reports:
        assert "error" not in r, r["error"]
        assert r["wrong"] == 0 and r["final_wrong"] == 0 and r["torn"] == 0, r
        assert r["write_failed"] == 0 and r["read_ok"] > 0, r
        assert r["final"] == {"ok": 32}, r
    assert not store_files(nodes.a)[1]
    assert [p.exitcode for p in procs] == [0, 0]


def test_eviction_on_one_node_while_the_other_reads(nodes):
    """Node A writes past its storage limit, round after round, so its evictor
    removes pages; node B reads every page A wrote, all the while (a thread of
    its own): every read is the page's bytes or a clean miss, never a torn or
    foreign file."""
    N = 24
    with make(nodes.a, geo=MID, pages=N, workers=2, storage_max_bytes=40 * (65536 + 4096),
              eviction_interval_s=0.05) as a, make(nodes.b, geo=MID, pages=N) as b:
        counts, wrong, written, rounds = {}, [], [0], [-1]  # rounds[0]: last round written
        stop = threading.Event()

        def reader():
            gone = set()
            while not stop.is_set():
                # Every page A wrote and B has not seen go: the oldest of them are
                # the ones A's evictor is removing (A never writes a key twice).
                every = [k for q in range(rounds[0] + 1) for k in (f"r{q}-{i}" for i in range(N))
                         if k not in gone]
                if not every:
                    time.sleep(0.01)
                for at in range(0, len(every), N):
                    chunk = every[at:at + N]
                    got = prefetch(b, chunk, range(len(chunk)))
                    wrong.extend(wrong_pages(b, got, _allowed(b)))
                    for c, n in got.status_counts().items():
                        counts[c] = counts.get(c, 0) + n
                    gone.update(k for k, code in zip(got.keys, got.page_status.tolist())
                                if code == st.MISS)

        def read_all():
            try:
                reader()
            except BaseException as exc:  # the test fails on it below
                failed.append(exc)

        failed = []
        t = threading.Thread(target=read_all)
        t.start()
        try:
            # 6 rounds of 24 are 144 pages for a 40-page limit: A's evictor runs from
            # the second round on, and B has met misses and hits by the third
            for r in range(6):
                keys = [f"r{r}-{i}" for i in range(N)]
                written[0] += _backup(a, keys, range(N)).ok_pages  # some dropped while A evicts
                rounds[0] = r
                time.sleep(0.1)
        finally:
            stop.set()
            t.join()
        assert not failed, failed
        assert written[0] > 40 and a.metrics()["evicted_pages"] > 0
        assert not wrong
        assert set(counts) <= {"ok", "miss"}, counts
        assert counts.get("miss", 0) > 0 and counts.get("ok", 0) > 0, counts


_NODE_A = r"""
import os, sys, time
sys.path[:0] = [sys.argv[2]]
from faultkit import BIG, content, make, put
keys = [f"k{i}" for i in range(8)]
e = make(sys.argv[1], geo=BIG, pages=8, workers=2, worker_batch=1)
for i, k in enumerate(keys):
    put(e, i, content(k, e.geometry.page_bytes))
print(" ".join(str(w.pid) for w in e._pool.workers), flush=True)
sys.stdin.readline()          # the parent has stopped a worker: go
op = e.backup(keys, range(8))
e.wait(op, 600)
"""


def test_node_killed_mid_write_leaves_no_page_and_spares_a_live_writer(nodes):
    """Node A (its own process: engine + workers) is SIGKILLed while a worker
    is inside a page write. Node B, meanwhile writing through a worker held
    mid-write itself, starts an engine (its scan reaps dead writers' temp
    files): A's half-written file never reads as data on B, A's temp file is
    removed, B's own live writer's temp file is not, and its write lands."""
    keys = [f"k{i}" for i in range(8)]
    faults = os.path.join(os.path.dirname(HERE), "faults")
    child = subprocess.Popen([sys.executable, "-c", _NODE_A, nodes.a, faults],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in child.stdout.readline().split()]
    try:
        os.kill(pids[1], signal.SIGSTOP)
        child.stdin.write("go\n")
        child.stdin.flush()
        tmp_a = stop_during_io(pids[1], lambda p: naming.TMP_MARK in p)
        assert tmp_a, "never caught node A's worker inside a write"
    finally:
        for pid in (child.pid, *pids):  # the whole node goes at once
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        child.wait()
    for pid in pids:  # reparented and reaped (a zombie is dead too: STORE's temp-owner rule)
        settle(lambda: not os.path.exists(f"/proc/{pid}"), 10)
    name_a = os.path.basename(tmp_a)
    # Node B: a writer held inside its own page write (live, holding a temp file).
    with make(nodes.b, geo=BIG, pages=16, workers=1, worker_batch=1) as writer:
        pb = writer.geometry.page_bytes
        victim = writer.worker_pids()[0]
        # On a loaded box one step can let a whole write through (its lane runs
        # it while the worker is let go): a missed write is let finish, and
        # another page tried with another step length.
        for attempt in range(4):
            live = f"live{attempt}"
            put(writer, 0, content(live, pb, 7))
            os.kill(victim, signal.SIGSTOP)
            op = writer.backup([live], [0])
            tmp_b = stop_during_io(victim, lambda p: naming.TMP_MARK in p,
                                   run_s=0.0002 * (1, 0.5, 2, 4)[attempt])
            if tmp_b:
                break
            os.kill(victim, signal.SIGCONT)
            assert writer.wait(op, 60) and op.status == "ok"
        try:
            assert tmp_b, "never caught node B's worker inside a write"
            with make(nodes.b, geo=BIG, pages=16, workers=1) as b:   # scans the store
                left = {os.path.basename(p) for p in store_files(nodes.b)[1]}
                assert name_a not in left, "the dead writer's temp file was not reaped"
                assert os.path.basename(tmp_b) in left, "a live writer's temp file was removed"
                got = prefetch(b, keys, range(8))
                assert not wrong_pages(b, got, _allowed(b))
                assert set(got.status_counts()) <= {"ok", "miss"}, got.status_counts()
                assert b.exists(keys) == got.completed_pages  # leading pages, as exists() counts
        finally:
            os.kill(victim, signal.SIGCONT)
        assert writer.wait(op, 60) and op.status == "ok"
        again = prefetch(writer, [live], [8])
        assert again.status == "ok" and get(writer, 8) == content(live, pb, 7)
    assert not store_files(nodes.a)[1]


def test_o_direct_on_fuse_probe_and_fallback(nodes):
    """JuiceFS's FUSE mount accepts O_DIRECT: the probe says so, and pages
    written O_DIRECT on node A read back O_DIRECT on node B byte-exact. Where
    O_DIRECT is not the choice (an unaligned geometry, or `auto` with a store
    that fits in RAM) the engine falls back to buffered I/O and says why."""
    ok, reason = directio.probe(nodes.a)
    assert ok, reason
    assert not [f for f in os.listdir(nodes.a) if f.startswith(directio.PROBE_MARK)]
    keys = [f"d{i}" for i in range(8)]
    with make(nodes.a, geo=BIG, pages=8, direct_io="on") as a, \
            make(nodes.b, geo=BIG, pages=8, direct_io="on") as b:
        assert a.metrics()["direct_io"] and b.metrics()["direct_io"]
        assert _backup(a, keys, range(8)).status == "ok"
        got = prefetch(b, keys, range(8))
        assert got.status == "ok" and not wrong_pages(b, got, _allowed(b))
    with make(nodes.b, geo=BIG, pages=8, direct_io="auto") as auto:
        m = auto.metrics()
        assert not m["direct_io"] and "page cache" in m["direct_io_reason"], m["direct_io_reason"]
        got = prefetch(auto, keys, range(8))
        assert got.status == "ok" and not wrong_pages(auto, got, _allowed(auto))
    with make(nodes.b, pages=8, direct_io="auto") as tiny:   # 1.5 KiB pages: unaligned
        m = tiny.metrics()
        assert not m["direct_io"] and "not multiples of 4096" in m["direct_io_reason"]
    with pytest.raises(ValueError, match="not multiples of 4096"):
        make(nodes.b, pages=8, direct_io="on")
