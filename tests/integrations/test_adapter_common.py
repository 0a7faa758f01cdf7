"""hicache_mp.integrations.common: what every framework adapter shares.

Real files, real mmaps, a real engine with worker processes; no framework needed.
"""
import math
import mmap
import os
import signal
import threading
import time
from dataclasses import dataclass

import pytest

import helpers
from hicache_mp.engine.config import EngineConfig
from hicache_mp.integrations.common import CallStats, RegionNotShared, Slots, check_known, \
    engine_config, engine_key, engine_keys, file_region, leading, open_region, own_settings, \
    settable_keys, wait_or_abandon
from hicache_mp.engine.config import parse_value, setting, settings


@dataclass
class TierSettings:
    """An adapter's own settings, declared as the adapters declare theirs."""
    drain_timeout_s: float = setting(math.inf, "a timeout", sglang=True, lo=0, lo_open=True,
                                     finite=False)

    def __post_init__(self):
        for f in settings(type(self)):
            setattr(self, f.name, parse_value(f, getattr(self, f.name)))


def test_slots_lend_and_take_back():
    s = Slots(4)
    assert s.take(3) == [0, 1, 2] and s.try_take(5) == [3] and s.try_take(1) == []
    assert s.take(1, timeout_s=0.05) == []          # none free: gives up, never hangs
    got = []
    t = threading.Thread(target=lambda: got.append(s.take(2)))
    t.start()
    time.sleep(0.05)
    s.give([2, 0])
    t.join(5)
    assert got == [[2, 0]] and s.available == 0
    k = Slots(4, keep_sorted=True)
    k.take(4)
    k.give([3, 1])
    assert k.free == [1, 3]
    with pytest.raises(ValueError):
        Slots(0)


def test_slots_lent_to_a_block_go_back_however_it_ends():
    s = Slots(3)
    with s.lent(2) as slots:
        assert slots == [0, 1] and s.available == 1
    assert s.available == 3
    with pytest.raises(RuntimeError, match="a copy failed"):
        with s.lent(5) as slots:
            assert slots == [2, 0, 1]
            raise RuntimeError("a copy failed")
    assert sorted(s.free) == [0, 1, 2]


def test_keys_become_engine_keys():
    raw = b"\x00\x01/..\xff" + (7).to_bytes(4, "big")
    assert engine_key(raw) == raw.hex() and engine_key("abc") == "abc"
    assert engine_keys([raw, "x"]) == [raw.hex(), "x"]
    assert leading(2, 4) == [True, True, False, False]
    with pytest.raises(ValueError):
        engine_key(5)


def test_options_build_the_engine_config(tmp_path):
    extra = {"storage_max_bytes": "1G", "write_checksum": "true", "num_workers": 2,
             "drain_timeout_s": "5", "type": "x"}
    known = settable_keys(TierSettings) | {"type"}
    assert check_known(extra, known) == [] and check_known({"oops": 1}, known) == ["oops"]
    assert own_settings(TierSettings, extra).drain_timeout_s == 5.0
    cfg = engine_config(extra, storage_dir=str(tmp_path), host_pool_pages=8,
                        defaults={"node_engines": 3, "num_workers": 9}, model_name="m")
    assert isinstance(cfg, EngineConfig)
    assert (cfg.storage_max_bytes, cfg.write_checksum, cfg.num_workers, cfg.node_engines,
            cfg.model_name, cfg.host_pool_pages) == (1 << 30, True, 2, 3, "m", 8)
    with pytest.raises(ValueError, match="storage_max_bytes"):
        engine_config({"storage_max_bytes": "lots"}, storage_dir=str(tmp_path),
                      host_pool_pages=8)
    with pytest.raises(ValueError, match="set by the adapter"):
        engine_config({"num_workers": 1}, storage_dir=str(tmp_path), host_pool_pages=8,
                      num_workers=2)


def test_stats_count_and_per_call_figures():
    s = CallStats(["get_calls"], per_call=False)
    s.record("prefetch", 4, 0.5, 1000, counter="get_calls")
    assert s.counters() == {"get_calls": 1} and s.take_calls()["prefetch_pgs"] == []
    s.per_call = True
    s.record("prefetch", 4, 0.5, 1000)
    s.count("staging_copies", 3)
    calls = s.take_calls()
    assert calls["prefetch_pgs"] == [4] and calls["prefetch_bandwidth"] == [8e-6]
    assert s.take_calls()["prefetch_pgs"] == [] and s.counters()["staging_copies"] == 3


def test_file_region_finds_the_shared_file_behind_a_buffer(tmp_path):
    path = str(tmp_path / "region")
    with open(path, "wb") as f:
        f.truncate(8 * 4096)
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 8 * 4096, flags=mmap.MAP_SHARED)
    view = memoryview(m)[2 * 4096:6 * 4096]
    region = file_region(view)
    assert (region.path, region.offset, region.nbytes) == (path, 2 * 4096, 4 * 4096)
    os.unlink(path)                                  # gone by name: found through our fd
    fd2 = open_region(file_region(view))
    try:
        os.pwrite(fd2, b"hello", 2 * 4096)
        assert bytes(view[:5]) == b"hello"          # the same bytes, not a copy
    finally:
        os.close(fd2)
    view.release()
    m.close()
    os.close(fd)
    anon = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE)
    with pytest.raises(RegionNotShared, match="not a file mapping"):
        file_region(memoryview(anon))
    path2 = str(tmp_path / "private")
    with open(path2, "wb") as f:
        f.truncate(4096)
    with open(path2, "r+b") as f:
        cow = mmap.mmap(f.fileno(), 4096, flags=mmap.MAP_PRIVATE)
        with pytest.raises(RegionNotShared, match="not shared"):  # workers' writes unseen
            file_region(memoryview(cow))
    with pytest.raises(RegionNotShared, match="empty"):
        file_region(b"")


def test_wait_or_abandon_ends_a_stuck_op(store):
    with helpers.engine(store, pages=8, workers=1) as eng:
        assert wait_or_abandon(eng, eng.backup(["k"], [0]), None)
        victim = eng.worker_pids()[0]
        os.kill(victim, signal.SIGSTOP)
        op = eng.prefetch(["k"], [1])
        try:
            assert wait_or_abandon(eng, op, 0.2) is False
        finally:
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert op.done and op.status in ("cancelled", "failed")
        again = eng.prefetch(["k"], [2])
        assert wait_or_abandon(eng, again, 30) and again.status == "ok"
