"""Daemonic parents, stale segments, torch-free workers: starting and stopping leave nothing behind.

Reaches inside: the engine's `_pool` (its workers' child handles, kept past
close() to read each worker's exit code: close() reaps them, so their pids
can no longer say how they ended).
"""
import multiprocessing as mp
import subprocess
import sys

import psutil

from shm import Segment, new_owner_tag
from shm.names import list_ours, clean_stale

from helpers import engine
from lifecycle_child import engine_in_a_daemon


# Worker and scheduler SIGKILLs live in tests/faults/ (test_worker_death.py,
# test_engine_death.py), with mid-read and mid-write variants.


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


def test_engine_starts_inside_a_daemonic_process(store):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=engine_in_a_daemon, args=(store, q), daemon=True)
    p.start()
    assert q.get(timeout=60) is True
    p.join(30)
    assert p.exitcode == 0


def test_workers_import_no_torch(store):
    with engine(store, pages=2, workers=1) as e:
        pid = e.worker_pids()[0]
        maps = open(f"/proc/{pid}/maps").read()
        assert "libtorch" not in maps, "a worker loaded torch"
        rss_mb = psutil.Process(pid).memory_info().rss / 2**20
        assert rss_mb < 200, f"worker uses {rss_mb:.0f} MB"


def test_a_worker_runs_only_its_own_threads(store):
    """numpy's import would start OpenBLAS's thread pool in every worker (a
    thread per core but one, and ~40 ms of its start); workers do no linear
    algebra, so they run their main thread and their I/O lanes only."""
    for depth in (1, 2):
        with engine(store, pages=2, workers=1, io_depth=depth) as e:
            pid = e.worker_pids()[0]
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            assert b"OPENBLAS_NUM_THREADS=1" in env
            # main thread + `depth` lanes (at depth 1, the write lane)
            assert psutil.Process(pid).num_threads() <= 1 + depth


def test_stopped_workers_exit_zero(store):
    """A worker asked to stop leaves through os._exit (workers.child: no
    interpreter teardown for close() to wait on) with its body's code, 0."""
    e = engine(store, pages=2, workers=2)
    children = [h.child for h in e._pool.workers]
    e.close()
    assert [c.returncode for c in children] == [0, 0]
