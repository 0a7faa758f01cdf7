"""Fixtures shared by every test: nothing may be left behind.

Every test is checked for leftover `hicache_mp.*` entries in /dev/shm and for
live `hicache_mp-worker` processes, after a short grace period for exits.
"""
import os
import sys
import tempfile
import time

import psutil
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shm.names import list_ours  # noqa: E402


def worker_pids() -> set[int]:
    pids = set()
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any("hicache_mp-worker" in part for part in (p.info["cmdline"] or [])):
                pids.add(p.pid)
        except (psutil.Error, TypeError):
            pass
    return pids


def _settle(check, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while True:
        left = check()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def nothing_left_behind():
    shm_before = set(list_ours())
    procs_before = worker_pids()
    yield
    shm_left = _settle(lambda: set(list_ours()) - shm_before)
    procs_left = _settle(lambda: worker_pids() - procs_before)
    assert not shm_left, f"test left shared memory behind: {sorted(shm_left)}"
    assert not procs_left, f"test left worker processes behind: {sorted(procs_left)}"


@pytest.fixture
def store(tmp_path):
    d = tmp_path / "store"
    d.mkdir()
    return str(d)


