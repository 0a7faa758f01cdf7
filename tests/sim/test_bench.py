"""A tiny real bench: real engines, real worker processes, a real temp store.

Checks figures a broken run would fail: the hit rate the scheduler actually
served, every request's TTFT, prefetched and backed-up bytes against the
workload's page counts, the byte check of prefetched pages (including that it
catches a corrupted page), and the JSON report's fields.
"""
import json
import os
import time

import pytest
import torch

from hicache_mp.bench.sim.bench import ALL_RUNS, Bench, BenchConfig, table_rows
from hicache_mp.bench.sim.profile import chrome_trace, format_breakdown, op_breakdown
from hicache_mp.bench.sim.summary import format_comparison, format_summary
from hicache_mp.bench.sim.workload import HIT_RATE, describe
from shm.names import SHM_DIR, owner_pid
from workers import naming, pagefile

N = 4   # 53 cached pages (SCALE): the workload's hit rate 0.860, within 0.02 of HIT_RATE
SCALE = 0.05


def _ours_in_shm():
    return [n for n in os.listdir(SHM_DIR) if owner_pid(n) == os.getpid()]


def _cfg(tmp_path, **kw):
    base = dict(num_requests=N, quick=True, prompt_scale=SCALE, storage_dir=str(tmp_path / "store"),
                max_run_s=60.0)
    base.update(kw)
    return BenchConfig(**base)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    bench = Bench(_cfg(tmp_path_factory.mktemp("bench"), runs=ALL_RUNS), log=lambda m: None)
    results = {}
    rep = bench.run(on_result=lambda label, res, figs: results.__setitem__(label, res))
    rep["_bench"], rep["_results"] = bench, results
    return rep


def test_every_run_serves_every_request(report):
    bench = report["_bench"]
    want_hit = describe(bench.requests)["hit_rate"]
    assert set(report["runs"]) == set(ALL_RUNS)
    for label, run in report["runs"].items():
        s = run["summary"]
        assert s["total_requests"] == N, label
        assert abs(s["cache_hit_rate"] - want_hit) <= 0.02, label
        assert abs(s["cache_hit_rate"] - HIT_RATE) <= 0.02, label
        reqs = run["requests"]
        assert len(reqs) == N
        for r in reqs:
            assert r["ttft_s"] > 0 and r["latency_s"] >= r["ttft_s"], (label, r)
            assert len(r["itl_s"]) == r["output_len"] - 1
        assert s["ttft_mean_s"] > 0 and s["input_token_throughput"] > 0
        assert run["extra"]["loop_iters_per_s"] > 0


def test_storage_runs_move_exactly_the_cached_and_computed_pages(report):
    bench = report["_bench"]
    ps, page_bytes = bench.cfg.page_size, bench.geometry.page_bytes
    cached = sum(r.cached_len // ps for r in bench.requests)
    computed = sum(r.prompt_len // ps - r.cached_len // ps for r in bench.requests)
    assert report["warmup"]["pages_written"] + report["warmup"]["pages_present"] == cached
    for label in ("file", "file+yield", "fast_file", "mp"):
        run = report["runs"][label]
        pf, bk = run["prefetch"], run["backup"]
        assert pf["ok_pages"] == cached and pf["bytes"] == cached * page_bytes, label
        assert pf["statuses"] == {"ok": pf["ops"]}, label
        assert run["engine"]["read_bytes"] == cached * page_bytes, label
        assert bk["ok_pages"] + bk["skipped_pages"] == computed, label
        assert bk["skipped_pages"] == 0, label
        assert run["engine"]["write_bytes"] == computed * page_bytes, label
        assert run["extra"]["prefetch_gbps_mean"] > 0 and run["extra"]["backup_gbps"] > 0
        assert run["verify"] == {"pages_checked": N, "failures": []}, label
    none = report["runs"]["none"]
    assert none["prefetch"]["bytes"] == 0 and none["backup"]["ops"] == 0
    assert none["extra"]["prefetch_gbps_mean"] is None
    assert report["runs"]["mp"]["engine"]["workers"] >= 1


def test_write_backs_are_removed_after_each_run(report):
    bench = report["_bench"]
    store = bench.cfg.storage_dir
    pages = [f for _, _, files in os.walk(store) for f in files if f.endswith(".page")]
    assert len(pages) == sum(r.cached_len // bench.cfg.page_size for r in bench.requests)


def test_report_is_json_and_compares_against_none(report, tmp_path):
    rep = {k: v for k, v in report.items() if not k.startswith("_")}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rep))
    back = json.loads(path.read_text())
    assert back["schema"] == "hicache_mp.bench/1"
    for key in ("created", "config", "machine", "workload", "warmup", "runs", "comparison"):
        assert key in back
    cfg = back["config"]
    assert cfg["geometry"]["num_layers"] == 4 and cfg["page_bytes"] == 256 * 1024
    assert cfg["prompt_scale"] == SCALE and cfg["time_scale"] == 0.2
    run = back["runs"]["mp"]
    for key in ("backend", "policy", "yield_ms", "duration_s", "loop_iters", "summary", "extra",
                "prefetch", "backup", "verify", "engine", "requests", "batches"):
        assert key in run
    assert back["runs"]["file+yield"]["yield_ms"] == 1.0
    cmp_ = back["comparison"]
    assert cmp_["baseline"] == "none"
    assert cmp_["ttft_mean_over_baseline"]["none"] == pytest.approx(1.0)
    table = format_comparison(table_rows(back["runs"]), baseline="none")
    for label in ALL_RUNS:
        assert any(line.startswith(label + " ") for line in table.splitlines())
    text = format_summary("mp", run["summary"], run["extra"])
    assert "Cache hit rate" in text and "Prefetch GB/s (mean)" in text


def test_profile_breakdown_and_trace(report):
    for label in ("file", "mp"):
        res = report["_results"][label]
        rows = op_breakdown(res.prefetch)
        assert len(rows) == len(res.prefetch) == N
        for r in rows:
            assert r["wall_ms"] > 0 and r["io_ms"] > 0
            assert 0 <= r["queue_ms"] <= r["wall_ms"] and r["drain_ms"] <= r["wall_ms"]
        trace = json.loads(json.dumps(chrome_trace(res)))
        ev = trace["traceEvents"]
        ops = [e for e in ev if e["ph"] == "X" and e["pid"] == 1 and e["tid"] >= 1000]
        assert len(ops) == len(res.prefetch) + len(res.backups)
        landed = sum(r.ok_pages for r in res.prefetch) + sum(r.ok_pages for r in res.backups)
        assert sum(1 for e in ev if e["ph"] == "i") == landed
        assert all(e["ts"] >= 0 for e in ev if "ts" in e)
        assert "mean" in format_breakdown(rows)


def test_nothing_left_in_shm(report):
    assert _ours_in_shm() == []


def test_byte_check_catches_a_corrupted_page(tmp_path):
    cfg = _cfg(tmp_path, num_requests=3, runs=("mp",))
    bench = Bench(cfg, log=lambda m: None)
    store = cfg.storage_dir
    os.makedirs(store)
    bench.warm_up(store)
    victim = bench.requests[1]
    ns = naming.namespace("default", bench.geometry.fingerprint())
    path = naming.page_path(store, naming.key_digest(victim.page_keys(cfg.page_size)[0], ns))
    with open(path, "r+b") as f:   # flip payload bytes; the header stays valid
        f.seek(pagefile.HEADER_SIZE + 100)
        f.write(b"\xff" * 64)
    res = bench.run_backend("mp", store)
    assert res.verify_failures == [victim.rid]
    assert _ours_in_shm() == []


@pytest.mark.parametrize("policy,timeout_s", [("best_effort", 10.0), ("timeout", 0.0)])
def test_policies_that_cut_prefetches_short_still_finish(tmp_path, policy, timeout_s):
    bench = Bench(_cfg(tmp_path, num_requests=4, runs=("mp",), policy=policy,
                       timeout_s=timeout_s), log=lambda m: None)
    rep = bench.run()
    run = rep["runs"]["mp"]
    assert run["summary"]["total_requests"] == 4
    assert all(r["ttft_s"] > 0 for r in run["requests"])
    # Whatever was cut short is recomputed, never served as a hit.
    assert run["summary"]["cache_hit_rate"] <= describe(bench.requests)["hit_rate"] + 1e-9
    assert run["verify"]["failures"] == []
    assert _ours_in_shm() == []


def test_stamp_marks_a_slot_in_both_layouts(tmp_path):
    import hashlib

    from hicache_mp import EngineConfig, PageGeometry, make_engine
    from hicache_mp.bench.sim.pagebytes import PageBytes
    for layout in ("page_first", "layer_first"):
        g = PageGeometry(2, 2, 32, 16, layout=layout)
        with make_engine("file", EngineConfig(storage_dir=str(tmp_path), host_pool_pages=4), g) as eng:
            pb = PageBytes(g)
            pb.fill(eng.host_pool, 1, "k1")
            assert pb.matches(eng.host_pool, 1, "k1") and not pb.matches(eng.host_pool, 1, "k2")
            pb.stamp(eng.host_pool, 2, "k2")
            raw = eng.host_pool.page_view(2).contiguous().view(-1).view(torch.uint8).numpy()
            assert raw[:32].tobytes() == hashlib.sha256(b"k2").digest()


@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
def test_device_load_puts_every_landed_page_on_the_device(tmp_path, policy):
    """With --device-load on (the CPU fallback here), every request waits for its
    pages to reach the device KV cache, and they hold the bytes that were written."""
    from hicache_mp.device import DeviceLoader

    seen = {}
    real_load = DeviceLoader.load

    def spy(self, op, device_pages, **kw):  # records what was asked; the real load runs
        h = real_load(self, op, device_pages, **kw)
        seen[op.id] = (self, h, list(op.keys), list(device_pages))
        return h

    DeviceLoader.load = spy
    try:
        bench = Bench(_cfg(tmp_path, runs=("mp",), device_load="on", policy=policy),
                      log=lambda m: None)
        results = {}
        rep = bench.run(on_result=lambda label, res, figs: results.__setitem__(label, res))
    finally:
        DeviceLoader.load = real_load
    run = rep["runs"]["mp"]
    assert run["summary"]["total_requests"] == N and not run["verify"]["failures"]
    assert run["extra"]["h2d_after_io_ms_mean"] is not None
    assert run["extra"]["h2d_after_io_ms_mean"] >= 0
    assert len(seen) == sum(1 for r in results["mp"].prefetch)
    for loader, h, keys, dev in seen.values():
        assert h.done and h.pages_loaded == h.op.completed_pages


def test_verdict_says_how_much_faster_mp_is_than_each_baseline():
    from hicache_mp.bench.sim.summary import format_verdict
    rows = {"none": {"ttft_mean_s": 0.5}, "file": {"ttft_mean_s": 6.0},
            "file+yield": {"ttft_mean_s": 0.49}, "fast_file": {"ttft_mean_s": 0.8},
            "fast_file-r4": {"ttft_mean_s": 0.4}, "mp": {"ttft_mean_s": 0.5}}
    line = format_verdict(rows)
    assert line == ("Verdict (mean TTFT, this run): mp is 12.0x faster than file, level with "
                    "file+yield (within 5%), 1.60x faster than fast_file, 1.25x slower than "
                    "fast_file-r4; mp takes 1.00x the ideal's (none).")
    assert format_verdict({"mp": {"ttft_mean_s": 0.5}}) == ""   # nothing to compare with


def test_a_run_on_a_busy_machine_says_so(report):
    from hicache_mp.bench.sim.bench import busy_machine_note
    for run in report["runs"].values():
        assert len(run["load_avg"]) == 2 and min(run["load_avg"]) >= 0
    quiet = {"mp": {"backend": "mp", "load_avg": [9.0, 16.0]},   # its own workers
             "file": {"backend": "file", "load_avg": [1.0, 2.9]}}
    assert busy_machine_note(quiet, cpus=2) == ""
    busy = {"mp": {"backend": "mp", "load_avg": [0.5, 1.9]},
            "file": {"backend": "file", "load_avg": [7.25, 3.0]}}
    note = busy_machine_note(busy, cpus=2)
    assert note.startswith("Note: this machine was busy (1-minute load average up to 7.2 on 2 CPUs)")


def test_gpu_time_adds_up_and_says_what_the_gpu_waited_for(report):
    """busy + idle by cause + the loop's lateness = the run; `none` never waits for
    storage, `mp` waits for its first prefetch before its first batch."""
    for label, run in report["runs"].items():
        g = run["gpu"]
        assert set(g["wait_s"]) == {"prefetch", "device", "slots", "arrival"}, label
        parts = g["busy_s"] + sum(g["wait_s"].values()) + g["late_s"]
        assert parts == pytest.approx(run["duration_s"], abs=1e-6), label
        assert 0 <= g["late_max_s"] <= g["late_s"] and g["start_s"] >= 0, label
        res = report["_results"][label]
        assert all(b[3] > 0 for b in res.batches), label   # no zero-token batch
        assert run["extra"]["gpu_start_s"] == g["start_s"]
    none, mp = report["runs"]["none"]["gpu"], report["runs"]["mp"]["gpu"]
    assert none["wait_s"]["prefetch"] == 0 and none["wait_s"]["device"] == 0
    assert mp["wait_s"]["prefetch"] > 0 and mp["start_s"] > none["start_s"]
    first = mp["first_prefetch"]
    assert first["rid"] == 0 and 0 <= first["submit_s"] <= first["done_s"]
    # The first batch waited for a prefetch to be seen done (the same clock).
    res = report["_results"]["mp"]
    seen = min((r.seen_ns - res.t0_ns) / 1e9 for r in res.prefetch)
    assert seen <= mp["start_s"] + 1e-9


def test_ttft_parts_sum_to_each_requests_ttft(report):
    """Every request's TTFT splits into parts that add up to it; the run's mean
    parts add up to its mean TTFT. `none` spends nothing on reads or H2D; `mp`
    spends its first request's wait on the read, which the parts must show."""
    from hicache_mp.bench.sim.ttftparts import PART_NAMES, format_parts
    for label, run in report["runs"].items():
        for r in run["requests"]:
            parts = r["ttft_parts"]
            assert tuple(parts) == PART_NAMES, label
            assert min(parts.values()) >= 0, (label, r["rid"], parts)
            assert sum(parts.values()) == pytest.approx(r["ttft_s"], abs=1e-9), (label, r["rid"])
            assert parts["prefill"] > 0, (label, r["rid"])   # every request computes a chunk
        tp = run["ttft_parts"]
        assert sum(tp["mean_s"].values()) == pytest.approx(run["summary"]["ttft_mean_s"], abs=1e-9)
        assert tp["ttft_mean_s"] == run["summary"]["ttft_mean_s"]
    none = report["runs"]["none"]["ttft_parts"]["mean_s"]
    assert none["first_page"] == none["read"] == none["h2d"] == 0.0
    first = report["runs"]["mp"]["requests"][0]["ttft_parts"]
    assert first["first_page"] + first["read"] > 0
    text = format_parts({k: v["ttft_parts"] for k, v in report["runs"].items()})
    assert text.splitlines()[2].startswith("none ") and "between" in text


def test_ttft_parts_hold_out_of_order_milestones_to_the_ttft():
    """A milestone seen a few µs after the batch start (a fresh clock), one never
    passed, and a cut-short read's last page after the first token: still parts
    that are never negative and sum to the TTFT."""
    from hicache_mp.bench.sim.ttftparts import request_parts
    marks = {"admit": 1.0, "submit": 1.1, "first_page": 1.2, "landed": 9.0, "seen": 1.5,
             "on_device": None, "first_batch": 1.4, "first_token": 2.0}
    parts = request_parts(marks, own_prefill_s=0.3)
    assert sum(parts.values()) == pytest.approx(1.0) and min(parts.values()) >= 0
    assert parts["read"] == pytest.approx(0.8) and parts["loop_saw"] == 0 == parts["gpu_queue"]
    assert parts["prefill"] == pytest.approx(0.0)   # nothing left of the span after the read
    marks.update(landed=1.3, seen=1.35, first_batch=1.4)
    parts = request_parts(marks, own_prefill_s=0.45)
    assert parts["prefill"] == pytest.approx(0.45) and parts["between_chunks"] == pytest.approx(0.15)
    assert sum(parts.values()) == pytest.approx(1.0)


class _SlowCopies:
    """A load handle that finishes DELAY_S after the real one: a GPU's copies take
    time, the CPU fallback's are done when issued."""
    DELAY_S = 0.03

    def __init__(self, real):
        self.real, self.op, self._at = real, real.op, None

    @property
    def done(self):
        if not self.real.done:
            return False
        if self._at is None:
            self._at = time.perf_counter() + self.DELAY_S
        return time.perf_counter() >= self._at

    def wait(self, timeout_s=None):
        ok = self.real.wait(timeout_s)
        time.sleep(self.DELAY_S)
        return ok


def test_kv_still_on_its_way_to_the_device_holds_no_gpu_time(tmp_path, monkeypatch):
    """A ready request whose pages are still loading is skipped: the GPU's wait is
    put down to the device, running requests keep decoding, and no zero-token
    prefill is recorded in the meantime."""
    from hicache_mp.device import DeviceLoader
    real_load = DeviceLoader.load

    def slow_load(self, op, device_pages, **kw):
        h = _SlowCopies(real_load(self, op, device_pages, **kw))
        op.device_event = h   # what the scheduler waits on before freeing the slots
        return h

    monkeypatch.setattr(DeviceLoader, "load", slow_load)
    bench = Bench(_cfg(tmp_path, runs=("mp",), device_load="on"), log=lambda m: None)
    got = {}
    rep = bench.run(on_result=lambda label, res, figs: got.update(res=res))
    run, res = rep["runs"]["mp"], got["res"]
    assert run["summary"]["total_requests"] == N and not run["verify"]["failures"]
    assert all(b[3] > 0 for b in res.batches)
    g = run["gpu"]
    # At least the first request's wait (less what a late loop step hides: a batch
    # starts at its iteration's first clock reading).
    assert g["wait_s"]["device"] > 0
    assert g["busy_s"] + sum(g["wait_s"].values()) + g["late_s"] == \
        pytest.approx(run["duration_s"], abs=1e-6)
    assert _ours_in_shm() == []


def test_storage_runs_say_how_much_of_the_store_was_in_the_page_cache(report):
    for label, run in report["runs"].items():
        share = run["page_cache"]
        if label == "none":
            assert share is None and run["extra"]["page_cache_first"] is None
            continue
        # A share, not a residency: other jobs on a shared box may drop the
        # page cache at any time (test_pagecache checks the measurement).
        assert 0.0 <= share["first_request"] <= 1.0 and 0.0 <= share["all"] <= 1.0, label
        assert run["extra"]["page_cache_first"] == share["first_request"]
