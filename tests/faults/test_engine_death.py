"""The scheduler dies with SIGKILL in the middle of a backup.

- Alone: its workers notice (parent watch) and exit within a second, and
  unlink the engine's shared memory on the way out.
- Together with its workers (an OOM kill of the whole group, a container
  stop): stale segments and a half-written temp file stay behind; the next
  engine on the same store removes both and serves every page the dead
  scheduler had seen completed.
"""
import json
import os
import signal
import subprocess
import sys
import time

import psutil

from shm.names import list_ours
from workers import naming

from faultkit import BIG, HERE, content, fingerprint, make, prefetch, stop_during_io, \
    store_files, wrong_pages

# Backs up batches of fresh keys forever; prints its tag and worker pids, then
# after each finished batch the keys whose pages were written.
SCHEDULER = """
import json, sys
sys.path.insert(0, sys.argv[2])
from faultkit import BIG, backup, make
e = make(sys.argv[1], geo=BIG, pages=16, workers=2, worker_batch=1)
print(json.dumps({"tag": e.tag, "workers": [w.pid for w in e._pool.workers]}), flush=True)
batch = 0
while True:
    keys = [f"b{batch}-{i}" for i in range(8)]
    op = backup(e, keys, range(8))
    print(json.dumps([k for k, s in zip(keys, op.page_status.tolist()) if s == 1]), flush=True)
    batch += 1
"""


def _start(store, new_session=False):
    proc = subprocess.Popen([sys.executable, "-c", SCHEDULER, store, HERE], stdout=subprocess.PIPE,
                            text=True, start_new_session=new_session)
    hello = json.loads(proc.stdout.readline())
    done = []
    for _ in range(2):  # let two batches finish, so there is something to serve later
        line = proc.stdout.readline()
        assert line, "scheduler child died"
        done += json.loads(line)
    return proc, hello["tag"], hello["workers"], done


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_workers_exit_within_a_second_of_their_scheduler(store):
    proc, tag, workers, _ = _start(store)
    proc.kill()
    t0 = time.monotonic()
    proc.wait()
    while not all(_gone(p) for p in workers):
        assert time.monotonic() - t0 < 1.0, "workers outlived their scheduler by more than 1 s"
        time.sleep(0.01)
    deadline = time.monotonic() + 2
    while [n for n in list_ours() if tag in n] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [n for n in list_ours() if tag in n], "orphaned workers did not unlink the segments"


def test_next_engine_cleans_up_after_a_killed_group_and_serves_completed_pages(store):
    proc, tag, workers, done = _start(store, new_session=True)
    assert [n for n in list_ours() if tag in n]
    victim = workers[0]
    os.kill(victim, signal.SIGSTOP)
    tmp = stop_during_io(victim, lambda p: naming.TMP_MARK in p)
    os.killpg(proc.pid, signal.SIGKILL)  # scheduler and workers at once: nobody cleans up
    proc.wait()
    for p in workers:
        try:
            psutil.Process(p).wait(5)
        except psutil.NoSuchProcess:
            pass
    assert tmp and store_files(store)[1], "the crash should have left a temp file"

    with make(store, geo=BIG, pages=16, workers=2) as e:
        # Removed by this engine's start (or by any engine another session on
        # this machine started meanwhile: each cleans every dead owner's names).
        assert not [n for n in list_ours() if tag in n]
        assert e.wait_scanned(30)  # the start's scan runs in the background (decision 110)
        assert e.metrics()["stale_tmp_removed"] >= 1 and not store_files(store)[1]
        assert e.exists(done) == len(done)
        pb = e.geometry.page_bytes
        for at in range(0, len(done), 16):
            keys = done[at:at + 16]
            op = prefetch(e, keys, range(len(keys)))
            assert op.status == "ok", op.status_counts()
            assert not wrong_pages(e, op, lambda k: {fingerprint(content(k, pb))})
