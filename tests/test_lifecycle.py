"""Worker and scheduler deaths, daemonic parents, stale segments: nothing hangs, nothing stays."""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from shm import Segment, new_owner_tag
from shm.names import list_ours, clean_stale

from helpers import engine, fill, random_pages, read_back


def test_sigkilled_worker_is_replaced_and_its_pages_fail(store):
    n = 48
    keys = [f"w{i}" for i in range(n)]
    with engine(store, pages=2 * n, workers=2, worker_batch=1) as e:
        data = random_pages(e.geometry, n)
        fill(e, range(n), data)
        assert e.wait(e.backup(keys, range(n)), 30)
        victim = e.pool.workers[1]  # page 0 goes to worker 0, so some pages lead
        os.kill(victim.pid, signal.SIGSTOP)   # freeze it with pages queued, then kill it
        op = e.prefetch(keys, range(n, 2 * n))
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert e.wait(op, 10), "op hung after a worker died"
        assert time.monotonic() - t0 < 10
        counts = op.status_counts()
        assert counts.get("worker_died", 0) > 0 and op.status == "partial"
        lead = op.completed_pages
        assert torch.equal(read_back(e, range(n, n + lead)).view(torch.int16),
                           data[:lead].view(torch.int16))  # landed pages are right, even if none
        assert e.metrics()["respawns"] == 1 and e.pool.workers[1].pid != victim.pid
        again = e.prefetch(keys, range(n, 2 * n))   # the next prefetch works
        assert e.wait(again, 30) and again.status == "ok"
        assert torch.equal(read_back(e, range(n, 2 * n)).view(torch.int16), data.view(torch.int16))


SCHEDULER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    from helpers import engine
    e = engine(sys.argv[1], pages=8, workers=2)
    print(e.tag, *[w.pid for w in e.pool.workers], flush=True)
    import time
    time.sleep(600)
""")


def test_sigkilled_scheduler_leaves_no_workers_and_no_segments(store):
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.Popen([sys.executable, "-c", SCHEDULER, store, here], stdout=subprocess.PIPE, text=True)
    tag, *pids = proc.stdout.readline().split()
    assert len(pids) == 2 and [n for n in list_ours() if tag in n]
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    while any(psutil.pid_exists(int(p)) and psutil.Process(int(p)).status() != psutil.STATUS_ZOMBIE
              for p in pids):
        assert time.monotonic() - t0 < 1.5, "workers outlived their scheduler"
        time.sleep(0.02)
    deadline = time.monotonic() + 2
    while [n for n in list_ours() if tag in n] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [n for n in list_ours() if tag in n], "orphaned workers did not unlink the segments"


def test_stale_segments_of_a_dead_owner_are_removed_at_start(store):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = new_owner_tag(dead.pid) + ".pool"
    seg = Segment.create(name, 4096)
    seg.map.close()  # the "crashed" owner never unlinked it
    assert name in list_ours()
    with engine(store, pages=2) as e:
        assert name in e.stale_removed
    assert name not in list_ours()
    alive = Segment.create(new_owner_tag() + ".mine", 4096)  # our own live pid: never touched
    try:
        assert alive.name not in clean_stale()
    finally:
        alive.close()


def _daemon_body(store, q):
    try:
        with engine(store, pages=4, workers=1) as e:
            fill(e, [0], random_pages(e.geometry, 1))
            q.put(e.wait(e.backup(["d"], [0]), 30) and e.exists(["d"]) == 1)
    except Exception as exc:  # report, don't hang the test
        q.put(repr(exc))


def test_engine_starts_inside_a_daemonic_process(store):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_daemon_body, args=(store, q), daemon=True)
    p.start()
    assert q.get(timeout=60) is True
    p.join(30)
    assert p.exitcode == 0


def test_workers_import_no_torch(store):
    with engine(store, pages=2, workers=1) as e:
        pid = e.pool.workers[0].pid
        maps = open(f"/proc/{pid}/maps").read()
        assert "libtorch" not in maps, "a worker loaded torch"
        rss_mb = psutil.Process(pid).memory_info().rss / 2**20
        assert rss_mb < 200, f"worker uses {rss_mb:.0f} MB"
