"""HiCacheMPTier through vLLM's real tiering classes (pinned: .ci/vllm-requirements.txt).

vLLM's own TieringOffloadingSpec parses the config and builds the tier through
SecondaryTierFactory; its SharedOffloadRegion is the CPU tier (a real mmap
file in /dev/shm) and primary_kv_view is its memoryview; jobs are vLLM's
TransferJob and answers its JobResult. The engine's workers are real
processes reading and writing real page files straight into that mmap.

Reaches inside: vLLM's `TieringOffloadingSpec._get_secondary_tiers` (the
parser vLLM's spec uses to resolve a tier's out-of-tree class, checked to
resolve ours) and its fs tier's `_HAS_FSIO_C` / `_HAS_BATCH_LOOKUP_C` flags
(the bench switches vLLM's C helpers through them; the smoke test saves and
restores them around it). No public vLLM call offers either.
"""
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import signal
import time
import uuid

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed; install it with "
                "`pip install --no-deps -r .ci/vllm-requirements.txt`", allow_module_level=True)

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from hicache_mp.integrations.vllm import HiCacheMPTier  # noqa: E402
from storagekit import store_bytes  # noqa: E402
from vllm_tiers import OURS, STEP, fill, finish, job, key, offloading_config, region_path, \
    resolve, rows_of, tiering  # noqa: E402

HIT, MISS = LookupResult.HIT, LookupResult.MISS
ROW = 64 << 10


def ours(store, **kw) -> dict:
    return {**OURS, "storage_dir": store, "num_workers": 2, **kw}


@pytest.fixture(autouse=True)
def no_region_left():
    before = {n for n in os.listdir("/dev/shm") if n.startswith("vllm_offload_hicache-test-")}
    yield
    left = {n for n in os.listdir("/dev/shm") if n.startswith("vllm_offload_hicache-test-")}
    assert not left - before, f"vLLM CPU-tier files left in /dev/shm: {sorted(left - before)}"


def test_vllms_factory_and_spec_build_the_tier(store):
    cfg = ours(store, storage_max_bytes="64M", write_checksum="true",
               backpressure={"backpressure_cls": "EMABackpressureDetector"})
    assert SecondaryTierFactory.get_tier_class(cfg) is HiCacheMPTier
    # vLLM's config parsing resolves the out-of-tree class (metric definitions, labels).
    extra = {"cpu_bytes_to_use": ROW * 8, "secondary_tiers": [cfg]}
    assert TieringOffloadingSpec._get_secondary_tiers(extra) == [(cfg, HiCacheMPTier)]
    assert "tier" in TieringOffloadingSpec.config_info_keys(extra)
    engine_id = f"hicache-test-{uuid.uuid4().hex[:8]}"
    with tiering([cfg], rows=8, engine_id=engine_id) as (spec, manager):
        tier = manager.secondary_tiers[0]
        assert isinstance(tier, HiCacheMPTier) and tier.tier_type == "HiCacheMPTier"
        assert isinstance(tier.bp_detector, EMABackpressureDetector)
        assert tier.region.path == region_path(engine_id)
        assert (tier.num_chunks, tier.row_bytes) == (8, ROW)
        cfg_e = tier.engine.config
        assert (cfg_e.storage_max_bytes, cfg_e.write_checksum, cfg_e.host_pool_pages) == \
            (64 << 20, True, 8)
        assert tier.engine.worker_count() == 2 and tier.engine.shared_pool
        assert "test/model" in tier.engine.namespace
        engine = tier.engine
    assert engine.closed and not os.path.exists(region_path(engine_id))


@pytest.mark.parametrize("bad, why", [
    ({"root_dir": "/tmp/x"}, "unknown key"),
    ({"storage_max_bytes": "lots"}, "storage_max_bytes"),
    ({"num_workers": -1}, "num_workers"),
    ({"drain_timeout_s": 0}, "drain_timeout_s"),
    ({"storage_dir": ""}, "storage_dir"),
    ({"storage_dir": '["/tmp/a", '}, "not a JSON list"),
    ({"storage_dir": '["/tmp/a", 5]'}, "list of directory names"),
    ({"storage_dir": "/tmp/a,,/tmp/b"}, "empty entry"),
    ({"enable_kv_events": "maybe"}, '"enable_kv_events": expected a boolean'),
    ({"locality": "bogus"}, '"locality" \'bogus\' is not one of \\[\'LOCAL\', \'REMOTE\'\\]'),
])
def test_bad_tier_config_is_refused_before_anything_starts(store, bad, why):
    with pytest.raises(ValueError, match=why):
        with tiering([ours(store, **bad)], rows=4):
            pass


def test_storage_dir_as_a_json_list_string_and_relative(tmp_path, monkeypatch, caplog):
    """docs/vllm.md: storage_dir may be a JSON list, and a front end may pass
    it as a string: its directories are used, never one literally named
    '["...'. A relative directory is resolved against the current directory
    (one INFO line), so the workers get the absolute path."""
    caplog.set_level(logging.INFO, logger="hicache_mp.vllm")
    dirs = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    monkeypatch.chdir(tmp_path)
    spec = json.dumps([dirs[0], "nvme1"])
    with tiering([ours(spec)], rows=8) as (_, manager):
        tier = manager.secondary_tiers[0]
        assert tier.engine.config.storage_dir == ",".join(dirs)
        view = rows_of(tier)
        fill(view, range(4), seed=4)
        tier.submit_store(job(1, [key(i) for i in range(4)], range(4), load=False))
        assert finish(tier, [1])[1].success
        del view
    assert sorted(os.listdir(tmp_path)) == ["nvme0", "nvme1"]
    assert sum(len(f) for d in dirs for _, _, f in os.walk(d)) == 4
    said = [r.getMessage() for r in caplog.records if "relative" in r.getMessage()]
    assert len(said) == 1 and dirs[1] in said[0], said


@pytest.mark.parametrize("value, on", [(True, True), ("true", True), ("false", False),
                                       ("no", False), (0, False)])
def test_enable_kv_events_is_parsed_as_a_boolean(store, value, on):
    """With vLLM's kv-cache events on, "false" and "no" keep the tier's events
    off (a plain truth test turned them on); a stored block is one event."""
    engine_id = f"hicache-test-{uuid.uuid4().hex[:8]}"
    cfg = dataclasses.replace(offloading_config(engine_id, ROW, 4, [
        ours(store, enable_kv_events=value)]), enable_kv_cache_events=True)
    manager = TieringOffloadingSpec(cfg).get_manager()
    try:
        tier = manager.secondary_tiers[0]
        assert (tier.events is not None) is on
        view = rows_of(tier)
        fill(view, [0], seed=5)
        del view
        tier.submit_store(job(1, [key(7)], [0], load=False))
        assert finish(tier, [1])[1].success
        assert len(list(tier.take_events())) == int(on)
    finally:
        manager.shutdown()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(region_path(engine_id))


def test_store_then_lookup_then_load_byte_exact(store):
    with tiering([ours(store)]) as (_, manager):
        tier = manager.secondary_tiers[0]
        view = rows_of(tier)
        keys = [key(i) for i in range(8)]
        data = fill(view, range(8), seed=1)
        tier.submit_store(job(1, keys, range(8), load=False))
        res = finish(tier, [1])[1]
        assert res.success and res.transfer_bytes == 8 * ROW
        assert resolve(tier, keys) == [HIT] * 8
        view[16:24] = 0
        tier.submit_load(job(2, keys, range(16, 24), load=True))
        res = finish(tier, [2])[2]
        assert res.success and res.successful_keys is None
        assert np.array_equal(view[16:24], data)
        # Stored again: nothing written, the job is settled at once.
        written = tier.engine.metrics()["write_pages_ok"]
        tier.submit_store(job(3, keys, range(8), load=False))
        assert finish(tier, [3])[3].success
        assert tier.engine.metrics()["write_pages_ok"] == written == 8
        del view


def test_through_vllms_tiering_manager(store):
    """vLLM's own flow: a GPU->CPU store cascades to this tier; after a cache
    reset a lookup promotes the chunks back (HIT_PENDING, then HIT)."""
    with tiering([ours(store)], rows=16) as (_, manager):
        view = rows_of(manager.secondary_tiers[0])
        keys = [key(100 + i) for i in range(6)]
        ctx = ReqContext(req_id="a")
        manager.on_new_request(ctx)
        out = manager.prepare_store(keys, ctx)
        stored_rows = list(out.store_spec.chunk_ids)
        data = fill(view, stored_rows, seed=2)       # the GPU->CPU copy
        manager.complete_store(keys, ctx)             # cascades: submit_store
        deadline = time.monotonic() + 30
        while manager.has_pending_work() and time.monotonic() < deadline:
            manager.on_schedule_end(STEP)
            time.sleep(0.001)
        manager.on_request_finished(ctx)
        manager.reset_cache()                         # drain_jobs; the CPU tier forgets all
        manager.on_reset_flushed()
        view[:] = 0
        ctx = ReqContext(req_id="b")
        manager.on_new_request(ctx)
        answers = []
        while time.monotonic() < deadline:
            answers = [manager.lookup(k, ctx) for k in keys]
            if answers == [HIT] * 6:
                break
            manager.on_schedule_end(STEP)            # submits the promotion
            time.sleep(0.001)
        assert answers == [HIT] * 6
        rows = manager.prepare_load(keys, ctx).chunk_ids
        got = view[np.asarray(rows)]
        assert np.array_equal(got, data)
        manager.complete_load(keys, ctx)
        manager.on_request_finished(ctx)
        del view


def test_misses(store):
    with tiering([ours(store)]) as (_, manager):
        tier = manager.secondary_tiers[0]
        view = rows_of(tier)
        data = fill(view, [0, 1], seed=3)
        tier.submit_store(job(1, [key(0), key(2)], [0, 1], load=False))
        assert finish(tier, [1])[1].success
        assert resolve(tier, [key(0), key(1), key(2)]) == [HIT, MISS, HIT]
        view[8:11] = 7
        keys = [key(0), key(1), key(2)]
        tier.submit_load(job(2, keys, [8, 9, 10], load=True))
        res = finish(tier, [2])[2]
        assert not res.success and res.successful_keys == (key(0), key(2))
        assert np.array_equal(view[[8, 10]], data) and (view[9] == 7).all()
        tier.submit_load(job(3, [key(5), key(6)], [11, 12], load=True))
        res = finish(tier, [3])[3]
        assert not res.success and res.successful_keys is None
        assert tier.engine.metrics()["misses"] == 3
        del view


def test_a_key_too_long_for_a_file_name_fails_cleanly(store, caplog):
    """vLLM's keys are hex text to the engine; one too long for a file name
    (over 4096 bytes) is a miss for lookup and a failed store or load job, with
    a warning, never an exception into vLLM's scheduler; other jobs go on."""
    caplog.set_level(logging.WARNING, logger="hicache_mp.vllm")
    long_key = make_offload_key(b"\x00/.." * 750, 0)   # 3004 bytes: 6008 as hex
    with tiering([ours(store)], rows=8) as (_, manager):
        tier = manager.secondary_tiers[0]
        view = rows_of(tier)
        data = fill(view, [0, 1], seed=6)
        for _ in range(2):
            assert tier.lookup(long_key, ReqContext(req_id="r")) == MISS
        tier.submit_store(job(1, [long_key], [0], load=False))
        tier.submit_store(job(2, [key(1), long_key], [1, 0], load=False))
        tier.submit_store(job(3, [key(2)], [1], load=False))
        tier.on_schedule_end(STEP)
        got = finish(tier, [1, 2, 3])
        assert not got[1].success and not got[2].success and got[3].success
        view[4:6] = 9
        tier.submit_load(job(4, [long_key], [4], load=True))
        tier.submit_load(job(5, [key(2)], [5], load=True))
        tier.on_schedule_end(STEP)
        got = finish(tier, [4, 5])
        assert not got[4].success and not got[4].successful_keys and got[5].success
        assert (view[4] == 9).all() and np.array_equal(view[5], data[1])
        del view
    said = [r.getMessage() for r in caplog.records if "refuses" in r.getMessage()
            or "longer than 4096" in r.getMessage()]
    assert 1 <= len(said) <= 3 and all("longer than 4096" in m for m in said), said


def test_one_steps_jobs_answer_each_for_itself(store):
    """A step's jobs go to the engine together; each job's answer is its own:
    a miss in one load fails only that one (its landed keys kept), stores of
    rows the step already writes are settled without a second write."""
    with tiering([ours(store)], rows=32) as (_, manager):
        tier = manager.secondary_tiers[0]
        view = rows_of(tier)
        keys = [key(700 + i) for i in range(9)]
        data = fill(view, range(9), seed=8)
        tier.submit_store(job(1, keys[:5], range(5), load=False))
        tier.submit_store(job(2, keys[5:], range(5, 9), load=False))
        tier.submit_store(job(3, keys[3:5], [3, 4], load=False))  # rows job 1 writes
        tier.on_schedule_end(STEP)
        got = finish(tier, [1, 2, 3])
        assert all(got[i].success for i in (1, 2, 3))
        assert tier.engine.metrics()["write_pages_ok"] == 9
        view[16:32] = 0
        absent = key(799)
        tier.submit_load(job(4, keys[:3], range(16, 19), load=True))
        tier.submit_load(job(5, [keys[3], absent, keys[4]], range(19, 22), load=True))
        tier.submit_load(job(6, keys[5:], range(22, 26), load=True))
        tier.on_schedule_end(STEP)
        got = finish(tier, [4, 5, 6])
        assert got[4].success and got[6].success
        assert not got[5].success and got[5].successful_keys == (keys[3], keys[4])
        assert got[4].transfer_bytes == 3 * ROW and got[5].transfer_bytes == 2 * ROW
        assert np.array_equal(view[16:19], data[:3]) and np.array_equal(view[22:26], data[5:])
        assert np.array_equal(view[[19, 21]], data[3:5]) and not view[20].any()
        del view


def test_store_stays_under_storage_max_bytes(store):
    limit = 12 * (4096 + ROW)
    with tiering([ours(store, storage_max_bytes=limit, eviction_interval_s=0.1)],
                 rows=16) as (_, manager):
        tier = manager.secondary_tiers[0]
        view = rows_of(tier)
        peak, rounds = 0, []
        for rnd in range(10):
            keys = [key(1000 + rnd * 8 + i) for i in range(8)]
            rows = range(8 * (rnd % 2), 8 * (rnd % 2) + 8)
            fill(view, rows, seed=rnd)
            tier.submit_store(job(10 + rnd, keys, rows, load=False))
            finish(tier, [10 + rnd])
            peak = max(peak, store_bytes(store))
            rounds.append(keys)
            time.sleep(0.15)  # one eviction pass
        assert peak <= limit, f"store reached {peak} bytes, limit {limit}"
        assert tier.engine.metrics()["evicted_pages"] > 0
        # LRU: the newest round's pages are kept before the round's before it.
        # (Within a round the first pages written are its oldest: a pass that
        # makes room for the round's last pages may take them, so which of the
        # round survive is not asked.)
        last, before = (resolve(tier, keys).count(HIT) for keys in rounds[-1:-3:-1])
        assert last >= 1 and last >= before, f"kept {last} of the newest round, {before} older"
        del view


def test_a_killed_worker_fails_its_pages_cleanly_and_later_jobs_work(store):
    with tiering([ours(store)], rows=32) as (_, manager):
        tier = manager.secondary_tiers[0]
        view = rows_of(tier)
        keys = [key(i) for i in range(8)]
        data = fill(view, range(8), seed=4)
        tier.submit_store(job(1, keys, range(8), load=False))
        assert finish(tier, [1])[1].success
        victim = tier.engine.worker_pids()[0]
        os.kill(victim, signal.SIGSTOP)      # holds its share of the load, then dies
        view[8:16] = 0
        tier.submit_load(job(2, keys, range(8, 16), load=True))
        os.kill(victim, signal.SIGKILL)
        res = finish(tier, [2])[2]
        assert not res.success
        good = [keys.index(k) for k in (res.successful_keys or ())]
        assert len(good) < 8
        assert np.array_equal(view[[8 + i for i in good]], data[good])
        deadline = time.monotonic() + 30
        while victim in tier.engine.worker_pids() and time.monotonic() < deadline:
            tier.get_finished_jobs()
            time.sleep(0.01)
        view[16:24] = 0
        tier.submit_load(job(3, keys, range(16, 24), load=True))
        res = finish(tier, [3])[3]
        assert res.success and np.array_equal(view[16:24], data)
        assert tier.engine.metrics()["read_status"].get("worker_died", 0) >= 1
        del view


def test_shutdown_with_jobs_in_flight(store):
    with tiering([ours(store)]) as (_, manager):
        tier = manager.secondary_tiers[0]
        view = rows_of(tier)
        fill(view, range(8), seed=5)
        keys = [key(i) for i in range(8)]
        tier.submit_store(job(1, keys, range(8), load=False))
        tier.shutdown()                      # lets the store finish (close(flush=True))
        got = finish(tier, [1], timeout_s=5)
        assert got[1].success
        tier.submit_load(job(2, keys, range(8, 16), load=True))
        tier.submit_store(job(3, [key(50)], [0], load=False))
        got = finish(tier, [2, 3], timeout_s=5)
        assert not got[2].success and not got[3].success
        assert tier.lookup(keys[0], ReqContext(req_id="x")) == MISS
        assert tier.engine.closed and os.path.exists(tier.region.path)  # vLLM's file
        tier.drain_jobs()
        del view


def test_two_vllm_instances_share_one_store(store):
    with tiering([ours(store)]) as (_, a), tiering([ours(store)]) as (_, b):
        ta, tb = a.secondary_tiers[0], b.secondary_tiers[0]
        assert ta.region.path != tb.region.path
        va, vb = rows_of(ta), rows_of(tb)
        keys = [key(500 + i) for i in range(6)]
        data = fill(va, range(6), seed=6)
        ta.submit_store(job(1, keys, range(6), load=False))
        assert finish(ta, [1])[1].success
        assert resolve(tb, keys) == [HIT] * 6   # found by B's workers' probes
        tb.submit_load(job(1, keys, range(10, 16), load=True))
        assert finish(tb, [1])[1].success
        assert np.array_equal(vb[10:16], data)
        del va, vb


def test_scheduler_calls_keep_the_gil(store):
    """Under a busy scheduler every GIL release costs vLLM's scheduler thread up to
    a switch interval: submitting, polling and 2,000 lookups must not let it go.
    Jobs of 125 rows (one request's chunks each; the engine's bulk drain of a
    single op of thousands of pages is the engine's own test)."""
    from faultkit import workers_counted
    from hicache_mp.bench.giltrace import released_in
    n, per = 2000, 125
    with tiering([ours(store)], row_bytes=4096, rows=2 * n) as (_, manager):
        tier = manager.secondary_tiers[0]
        view = rows_of(tier)
        keys = [key(i) for i in range(n)]
        data = fill(view, range(n), seed=7)

        def submit(load: bool):
            for j in range(0, n, per):
                rows = range(j + (n if load else 0), j + per + (n if load else 0))
                (tier.submit_load if load else tier.submit_store)(
                    job(j // per, keys[j:j + per], rows, load=load))
        ids = list(range(n // per))
        _, found = released_in(submit, False)
        assert not found, f"submit_store let the GIL go: {found}"
        _, found = released_in(tier.on_schedule_end, STEP)   # the step's end: its op starts
        assert not found, f"on_schedule_end (the step's stores) let the GIL go: {found}"
        # The engine's drain is tests/test_gil_hold.py's to check: drained first,
        # what is measured is what the tier adds (results for 16 finished jobs).
        workers_counted(tier.engine, n)  # every row written
        tier.engine.poll()
        got, found = released_in(tier.get_finished_jobs)
        assert not found, f"get_finished_jobs let the GIL go: {found}"
        results = {r.job_id: r for r in got}
        results.update(finish(tier, set(ids) - set(results)))
        assert all(results[i].success for i in ids)
        _, found = released_in(lambda: [tier.lookup(k, ReqContext(req_id="g")) for k in keys])
        assert not found, f"lookup() of {n} keys let the GIL go: {found}"
        _, found = released_in(submit, True)
        assert not found, f"submit_load let the GIL go: {found}"
        assert all(r.success for r in finish(tier, ids).values())
        assert np.array_equal(view[n:], data)
        unknown = [key(10 ** 6 + i) for i in range(n)]
        for k in unknown:
            tier.lookup(k, ReqContext(req_id="g"))
        _, found = released_in(tier.on_schedule_end, STEP)   # one batch of probes
        assert not found, f"on_schedule_end (probes for {n} keys) let the GIL go: {found}"
        assert resolve(tier, unknown[:50]) == [MISS] * 50
        del view


def test_a_poll_with_nothing_new_does_constant_work(store):
    """With 40 jobs in flight and the workers stopped (nothing can finish), each
    get_finished_jobs() answers [] after one engine poll that drains nothing,
    keeps the GIL, and settles nothing; once the workers go on, every job
    reports, byte-exact."""
    from hicache_mp.bench.giltrace import released_in
    n, per = 160, 4
    with tiering([ours(store)], rows=2 * n, row_bytes=4096) as (_, manager):
        tier = manager.secondary_tiers[0]
        view = rows_of(tier)
        keys = [key(3000 + i) for i in range(n)]
        data = fill(view, range(n), seed=9)
        tier.submit_store(job(1, keys, range(n), load=False))
        assert finish(tier, [1])[1].success
        pids = tier.engine.worker_pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            ids = list(range(10, 10 + n // per))
            for i, j in enumerate(range(0, n, per)):
                tier.submit_load(job(ids[i], keys[j:j + per], range(n + j, n + j + per),
                                     load=True))
            before = tier.engine.metrics()
            for _ in range(200):
                assert list(tier.get_finished_jobs()) == []
            got, found = released_in(tier.get_finished_jobs)
            assert list(got) == [] and not found, f"get_finished_jobs let the GIL go: {found}"
            after = tier.engine.metrics()
            assert after["poll_calls"] - before["poll_calls"] == 201  # one per call, not per job
            assert after["read_pages_ok"] == before["read_pages_ok"]
            assert tier.metrics()["jobs_in_flight"] == len(ids)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        results = finish(tier, ids)
        assert all(r.success for r in results.values())
        assert np.array_equal(view[n:], data)
        del view


def test_bench_smoke(tmp_path, monkeypatch):
    """scripts/bench_vllm_tier.py --quick: every row verified, ratios from the same run.
    Its main() runs in this process, which imported vLLM at collection: a child
    of its own spent ~8 s of the test importing it again."""
    import json

    from hicache_mp.bench.vllm import tier as bench_vllm_tier
    from vllm.v1.kv_offload.tiering.fs import io, manager
    # the bench switches vLLM's fs tier between its C helper and Python (set_fs_c)
    monkeypatch.setattr(io, "_HAS_FSIO_C", io._HAS_FSIO_C)
    monkeypatch.setattr(manager, "_HAS_BATCH_LOOKUP_C", manager._HAS_BATCH_LOOKUP_C)
    out = tmp_path / "bench.json"
    assert bench_vllm_tier.main(["--quick", "--io", "warm", "--store", str(tmp_path / "stores"),
                                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    tiers = {(r["tier"], r["mode"]) for r in res["rows"]}
    assert {("hicache_mp", "idle"), ("hicache_mp", "busy"), ("fs Python", "busy")} <= tiers
    for r in res["rows"]:
        assert "error" not in r, r
        assert r["load"]["wrong_bytes"] == 0
        assert r["load"]["bytes_verified"] == 16 * (64 << 10), r
    assert any(k.startswith("load busy warm: hicache_mp / best fs Python") for k in res["ratios"])
    # The loop's floor beside the busy warm load: plain readers copied every row
    # the tier stored, and the loop's rate beside them is the engine's divisor.
    floor = [r for r in res["rows"] if r["tier"] == "hicache_mp" and r["mode"] == "busy"]
    assert floor and all(r["floor"]["rows"] == 16 and r["floor"]["loop_rate"] > 0 for r in floor)
    assert all(r["loop_over_floor"] > 0 for r in floor)
    assert all(look["hits"] == look["keys"] == 200 for look in res["lookups"])
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("vllm_offload_bench-")]
