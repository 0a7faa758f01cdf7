"""The shared filesystem's client dies under a running engine (issue 23: the
shared-cluster fault suite).

A JuiceFS mount is a supervisor holding the FUSE connection and a client
serving it (hicache_mp/bench/jfs.py). Both killed: the mount is dead (ENOTCONN)
until the operator mounts it again. The client alone killed: JuiceFS's
supervisor starts another on the same connection and requests wait for it.

Either way, under an engine that keeps backing up and prefetching: every op
ends (no hang), every page reported ok holds exactly the bytes backed up
under its key, no page whose backup was acknowledged is lost, and once the
mount serves again the same engine (no restart) reads and writes as before.

Each test has a volume of its own: killing the session volume's clients
would break the other tests' mounts.
"""
import os
import random
import threading
import time

import pytest

import jfskit
from hicache_mp.bench import jfs
from faultkit import MID, content, fingerprint, make, poison, put, wrong_pages

PER_OP = 8


@pytest.fixture
def volume(tmp_path):
    root = tmp_path / "jfs"
    root.mkdir()
    with jfskit.volume_or_skip(str(root), nodes=1) as vol:
        yield vol


class Load:
    """Rounds of one backup of new keys and one prefetch of acknowledged ones."""

    def __init__(self, e):
        self.e, self.pb = e, e.geometry.page_bytes
        self.acked: list[str] = []
        self.rounds = 0
        self.statuses: dict[str, int] = {}
        self.rng = random.Random(0)

    def _allowed(self, k):
        return {fingerprint(content(k, self.pb))}

    def round(self, wait_s: float = 30) -> tuple:
        e, n = self.e, self.rounds
        _unfenced(e)
        self.rounds += 1
        keys = [f"r{n}-{j}" for j in range(PER_OP)]
        for j, k in enumerate(keys):
            put(e, j, content(k, self.pb))
        wop = e.backup(keys, range(PER_OP))
        rkeys = self.rng.sample(self.acked, min(PER_OP, len(self.acked)))
        slots = range(PER_OP, PER_OP + len(rkeys))
        poison(e, slots)
        rop = e.prefetch(rkeys, slots) if rkeys else None
        for op in (wop, rop):
            if op is None:
                continue
            t0 = time.monotonic()
            assert e.wait(op, wait_s), f"an op hung {time.monotonic() - t0:.1f} s: {op}"
            for s, c in op.status_counts().items():
                self.statuses[s] = self.statuses.get(s, 0) + c
        assert rop is None or not wrong_pages(e, rop, self._allowed)
        self.acked += [k for k, s in zip(keys, wop.page_status.tolist()) if s == 1]  # status.OK
        return wop, rop

    def run_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.round()

    def every_acknowledged_page_reads_back(self) -> None:
        e = self.e
        _unfenced(e)
        for i in range(0, len(self.acked), PER_OP):
            keys = self.acked[i:i + PER_OP]
            slots = range(PER_OP, PER_OP + len(keys))
            poison(e, slots)
            op = e.prefetch(keys, slots)
            assert e.wait(op, 30)
            assert op.status == "ok", (op.status_counts(), keys)
            assert not wrong_pages(e, op, self._allowed)


def _unfenced(e, timeout_s: float = 10) -> None:
    """Wait until no host slot is fenced: a stuck worker's slots stay reserved
    until it is reaped (decision 38), and the rounds reuse them."""
    deadline = time.monotonic() + timeout_s
    while e.metrics()["fenced_pages"]:
        assert time.monotonic() < deadline, "a fence never lifted"
        e.poll()
        time.sleep(0.01)


def _store(vol) -> str:
    path = os.path.join(vol.mounts[0], "store")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _kill_during(load: Load, kill) -> None:
    """Run rounds; `kill()` on another thread while they go on."""
    killer = threading.Timer(0.3, kill)
    killer.start()
    try:
        load.run_for(0.6)
    finally:
        killer.join()


def test_client_and_supervisor_killed_then_mounted_again(volume):
    with make(_store(volume), geo=MID, pages=2 * PER_OP, workers=2) as e:
        load = Load(e)
        _kill_during(load, lambda: volume.kill(0))
        assert not jfs.client_pids(volume.meta)
        # Dead mount: ops end with failure statuses at once, never hang.
        t0 = time.monotonic()
        wop, rop = load.round(wait_s=10)
        assert wop.status == "failed" and rop.status == "failed", (wop, rop)
        assert time.monotonic() - t0 < 5
        volume.remount(0)
        # The same engine, no restart: everything works again.
        wop, rop = load.round()
        assert wop.status == "ok" and rop.status == "ok", (wop, rop)
        load.run_for(0.3)
        load.every_acknowledged_page_reads_back()
        assert e.metrics()["stuck_workers"] == 0
    failed = sum(v for k, v in load.statuses.items() if k != "ok")
    assert failed > 0, f"the dead mount failed no page: {load.statuses}"
    assert len(load.acked) >= 3 * PER_OP, load.statuses


def test_client_killed_and_restarted_by_its_supervisor(volume):
    # Requests the killed client had taken may never be answered: a worker
    # caught in one is stuck, and the watchdog ends it within stall_timeout_s.
    if len(jfs.client_pids(volume.meta, volume.mounts[0])) < 2:
        pytest.skip("this JuiceFS runs its client without a supervisor")
    with make(_store(volume), geo=MID, pages=2 * PER_OP, workers=2, stall_timeout_s=3.0) as e:
        load = Load(e)
        killed = []
        _kill_during(load, lambda: killed.extend(volume.kill(0, supervisor=False)))
        assert len(killed) == 1
        deadline = time.monotonic() + 10
        while not [p for p in jfs.client_pids(volume.meta) if p not in killed]:
            assert time.monotonic() < deadline, "the supervisor started no new client"
            time.sleep(0.05)
        # Once the new client serves, whatever the watchdog did: every round ok.
        deadline = time.monotonic() + 20
        while True:
            wop, rop = load.round()
            if wop.status == "ok" and rop.status == "ok":
                break
            assert time.monotonic() < deadline, (wop, rop, load.statuses)
        load.run_for(0.3)
        load.every_acknowledged_page_reads_back()
    assert len(load.acked) >= 3 * PER_OP, load.statuses
