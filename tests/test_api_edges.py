"""API edges (issue 11, item 9): close() from another thread, timeouts, the
default policy the README's loop relies on, a store path that cannot be made.

Reaches inside: the engine's `_sleepers` (the threads asleep in it: close()
from another thread is tested once all three waiters sleep, so it has to
wake them, not find them still on their way in; no public call counts them).
"""
import contextlib
import errno
import math
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from hicache_mp import EngineClosed, EngineConfig

from faultkit import resume_when_told_to_stop, run_child, settle
from helpers import engine, fill, geometry, random_pages


def test_close_from_another_thread_while_waiting_gives_engine_closed(store):
    e = engine(store, pages=8, workers=1)
    g = e.geometry
    fill(e, [0], random_pages(g, 1))
    e.wait(e.backup(["a"], [0]), 30)
    worker = e.worker_pids()[0]
    os.kill(worker, signal.SIGSTOP)  # the op cannot finish: the waiter stays asleep
    resume_when_told_to_stop(e, 0)  # close() lets it go, not a timer
    try:
        op = e.prefetch(["a"], [1])
        got = []

        def waiter():
            try:
                got.append(e.wait(op))
            except BaseException as exc:
                got.append(exc)

        threads = [threading.Thread(target=waiter) for _ in range(3)]
        for t in threads:
            t.start()
        assert settle(lambda: len(e._sleepers) == 3, 10, 0.002), "the waiters never slept"
        closer = threading.Thread(target=e.close)
        closer.start()
        closer.join(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
    for t in threads:
        t.join(30)
    assert len(got) == 3 and all(isinstance(x, EngineClosed) for x in got), got
    with pytest.raises(EngineClosed):
        e.wait(op, 1)


@pytest.mark.parametrize("timeout", [float("inf"), None])
def test_no_timeout_means_wait_until_done(store, timeout):
    with engine(store, pages=4, workers=1) as e:
        fill(e, [0], random_pages(e.geometry, 1))
        op = e.backup(["a"], [0])
        assert e.wait(op, timeout) is True and op.done
        op = e.prefetch(["a"], [1], timeout_s=timeout, policy="timeout")
        assert e.wait(op, timeout) and op.status == "ok"


@pytest.fixture(scope="module")
def idle_engine(tmp_path_factory):
    """One engine for the bad-timeout cases: each ends with its op done and its
    slot free, so the next case finds the engine as the first did."""
    with engine(str(tmp_path_factory.mktemp("edges")), pages=4, workers=1) as e:
        yield e


@pytest.mark.parametrize("bad", ["1", -1, -0.5, float("nan"), True, [1]])
def test_a_bad_timeout_is_a_value_error(idle_engine, bad):
    e = idle_engine
    op = e.prefetch(["a"], [0])
    with pytest.raises(ValueError, match="timeout_s"):
        e.wait(op, bad)
    with pytest.raises(ValueError, match="timeout_s"):
        e.prefetch(["b"], [1], timeout_s=bad)
    assert e.wait(op, 30) and e.metrics()["ops_in_flight"] == 0


def test_the_readme_loop_waits_for_the_pages(store):
    """`while not op.ready(): engine.poll()` under the library's default policy
    ends only when the pages are there (it ended at once under best_effort)."""
    assert EngineConfig(storage_dir=store).prefetch_policy == "wait_complete"
    with engine(store, pages=8, workers=2) as e:
        data = random_pages(e.geometry, 4, seed=3)
        fill(e, range(4), data)
        assert e.wait(e.backup([f"k{i}" for i in range(4)], range(4)), 30)
        op = e.prefetch([f"k{i}" for i in range(4)], range(4, 8))
        while not op.ready():
            e.poll()
        assert op.done and op.status == "ok"


def test_bench_on_a_storage_dir_that_cannot_be_made_prints_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = subprocess.run([sys.executable, "-m", "hicache_mp.cli", "bench", "--quick",
                          "--storage-dir", str(blocker / "store")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--storage-dir" in lines[0] and "Not a directory" in lines[0], \
        out.stderr
    assert "Traceback" not in out.stderr


def _store_dir_refused(path: str, reason: str) -> None:
    """The engine refuses `path` with one error that names the setting, the
    path, the reason and the fix, before any worker or segment exists."""
    from shm.names import list_ours
    from workers.store import StoreDirError
    me = psutil.Process()
    before, kids = set(list_ours()), {p.pid for p in me.children()}  # an earlier test's may exit
    with pytest.raises(StoreDirError) as caught:
        engine(path, pages=4, workers=1)
    msg = str(caught.value)
    assert isinstance(caught.value, OSError) and isinstance(caught.value, ValueError)
    assert "storage_dir" in msg and repr(path) in msg and reason in msg, msg
    assert "a directory this user can create and write" in msg, msg
    assert not set(list_ours()) - before and not {p.pid for p in me.children()} - kids, msg


def test_a_store_dir_that_cannot_be_made_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    _store_dir_refused(str(blocker), os.strerror(errno.ENOTDIR))      # a file
    _store_dir_refused(str(blocker / "store"), os.strerror(errno.ENOTDIR))  # under a file
    _store_dir_refused("/proc/hicache-mp-store", os.strerror(errno.ENOENT))  # no dirs there
    assert not os.path.exists("/proc/hicache-mp-store")


UNCREATABLE_BODY = """
from workers.store import StoreDirError
from faultkit import make
try:
    make(args[0], pages=4, workers=1)
except StoreDirError as exc:
    result["error"] = [exc.errno, str(exc)]
"""


def test_a_store_dir_this_user_cannot_create_is_one_clear_error(tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir(mode=0o500)
    got = run_child(UNCREATABLE_BODY, str(parent / "store"))
    assert got["error"][0] == errno.EACCES, got
    assert "storage_dir" in got["error"][1] and os.strerror(errno.EACCES) in got["error"][1]


def test_config_timeout_may_be_infinite_and_nothing_else_odd(store):
    assert math.isinf(EngineConfig(storage_dir=store, prefetch_timeout_s="inf").prefetch_timeout_s)
    with pytest.raises(ValueError):
        EngineConfig(storage_dir=store, prefetch_timeout_s="soon")
