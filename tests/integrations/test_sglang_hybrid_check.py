"""scripts/sglang_hybrid_check.py on tiny geometries: SGLang's real
HybridCacheController over its real Mamba, SWA and DSA host pool groups, mp
with the no-bytes and sleeping floors interleaved, idle and busy, the GIL tracer's
per-call table; every KV and sidecar page read is exact.

Reaches inside: the bench rank's `_pages` and `_buffers` (where a label's
pages lie in SGLang's host pool buffers: the test flips one byte of a
sidecar page read there, a fault the rank's byte check must count; the rank
has no public call to damage its own pool).
"""
import os

import pytest

from hybrid_stack import load_or_skip

S = load_or_skip()

import torch  # noqa: E402

from hicache_mp.bench.sglang import hybrid_check as sglang_hybrid_check  # noqa: E402
from hicache_mp.bench.sglang import hybrid_rank as sglang_hybrid_rank  # noqa: E402
from hicache_mp.bench.sglang import real_hybrid as sglang_real_hybrid  # noqa: E402
from hicache_mp.bench.sglang.stack import Scheduler  # noqa: E402

TINY = ["--tiny", "--round-pages", "4", "--requests", "2", "--runs", "2", "--trace-runs", "1",
        "--workers", "1"]
GEOMS = ("mamba", "swa", "dsa")
SIDE = {"mamba": 1, "swa": 2, "dsa": 4}   # sidecar pages per request of 4 KV pages
# SGLang's calls per request of 4 pages: one hit query, one KV batch, and
# batch_get_v2 of the sidecar; DSA's indexer is read with the KV batch, and
# the sidecar step still calls batch_get_v2, with no transfer
V2 = {"mamba": 1.0, "swa": 1.0, "dsa": 2.0}


def test_hybrid_harness_drives_sglangs_controller(tmp_path):
    res = sglang_hybrid_check.main([*TINY, "--sleep-floor", "--store", str(tmp_path),
                                    "--json", str(tmp_path / "h.json")])
    assert os.path.getsize(tmp_path / "h.json") > 0
    assert res["summary"]["wrong_pages"] == 0
    assert set(res["geometries"]) == set(GEOMS)
    for g in GEOMS:
        geo = res["geometries"][g]
        facts = geo["sglang"]
        assert facts["controller"].endswith("hybrid_cache_controller.HybridCacheController")
        assert facts["host_pool_group"] == "HostPoolGroup" and facts["anchor"] == "kv"
        assert set(facts["pools"]) == {"kv", {"mamba": "mamba", "swa": "swa",
                                              "dsa": "indexer"}[g]}
        assert facts["is_mla_model"] == (g == "dsa")   # what SGLang derives from the device pool
        assert len(facts["threads"]) == 4               # SGLang's storage threads, running
        r = geo["sizes"]["4"]
        assert r["wrong_pages"] == 0
        # every KV and sidecar page of every mp round (warm, timed, traced) of 2 requests
        assert r["checked_pages"] == (1 + 2 * 2 + 2 * 1) * 2 * (4 + SIDE[g])
        want = {"batch_exists_v2": 1.0, "batch_get_v1": 1.0, "batch_get_v2": V2[g]}
        assert r["calls_per_request"] == r["nobytes_calls_per_request"] == want
        assert r["empty_v2_calls_per_request"] == ({"batch_get_v2": 1.0} if g == "dsa" else {})
        # both floors ran in the same run, run for run beside mp; the sleeping
        # one slept per batch what mp's idle batch took
        for k in ("mp", "nobytes", "sleeping"):
            assert len(r["runs_s"][f"{k}_idle"]) == len(r["runs_s"][f"{k}_busy"]) == 2
            assert r[f"{k}_loop_rate"] > 0
        assert len(r["own_ms_per_request_runs"]) == len(r["own_ms_per_batch_get_runs"]) == 2
        # per batch_get call: all of a request's batch_get_v1 and batch_get_v2 calls
        assert r["own_ms_per_batch_get"] == pytest.approx(
            r["own_ms_per_request"] / (1 + V2[g]))
        assert r["loop_rate_mp_over_floor"] > 0 and r["mp_idle_gbps"] > 0
        assert r["sleep_floor_sleep_ms"] > 0 and r["sleeping_busy_over_idle"] > 0
        assert len(r["own_beyond_sleeping_ms_per_batch_get_runs"]) == 2
        # the tracer saw SGLang's threads make the calls, per backend, mode and backup
        trace = res["gil_trace"]
        for kind in ("mp", "nobytes"):
            calls = trace[f"{g}-4:{kind}:busy"]["by_call"]
            for name in ("batch_exists_v2", "batch_get_v1", "batch_get_v2"):
                assert calls[name]["calls"] == 2 * want[name], (g, kind, name)
                assert calls[name]["c_calls_over_1ms"] >= 0
            backup = trace[f"{g}-4:{kind}:backup-busy"]["by_call"]
            assert backup["batch_set_v2"]["calls"] == backup["batch_set_v1"]["calls"] == 2
        # the no-bytes backend moves nothing, so it sleeps nowhere
        nb = trace[f"{g}-4:nobytes:busy"]["by_call"]
        assert not any("wake.py" in site for c in nb.values() for site in c["sites"])
        # the sleeping floor's backups and hit queries never sleep; its gets do
        sl = trace[f"{g}-4:sleeping:busy"]["by_call"]
        assert sl["batch_get_v1"]["calls"] == 2 and sl["batch_exists_v2"]["c_calls_over_1ms"] == 0
    assert any(row.startswith("| mamba-4:mp:busy | batch_get_v2 | 2 |")
               for row in res["gil_trace_table"])
    assert "mamba-4:mp:warm" not in " ".join(res["gil_trace_table"])


@pytest.mark.parametrize("geom", GEOMS)
def test_byte_check_finds_a_wrong_sidecar_page(geom, tmp_path):
    """The check compares every page: one flipped byte in a sidecar page read is one wrong page."""
    g = sglang_real_hybrid.geometry(geom, tiny=True)
    rank = sglang_hybrid_rank.Rank(S, g, "mp", str(tmp_path), requests=1, max_pages=3,
                                   workers=1)
    side = {"mamba": 1, "swa": 2, "dsa": 3}[geom]
    try:
        assert rank.backup(3, Scheduler(False), 30)
        _, out = rank.prefetch(3, Scheduler(False), 30)
        rank.finish(3, out, "clean")
        assert (rank.wrong, rank.checked) == (0, 3 + side)
        _, out = rank.prefetch(3, Scheduler(False), 30)
        (_, op, _), = out.values()
        label = {"mamba": "mamba", "swa": "swa", "dsa": "indexer"}[geom]
        idx = op.host_indices if label == "indexer" else op.pool_transfers[0].host_indices
        page = rank._pages("kv" if label == "indexer" else label, idx)[-1]
        t, axis = rank._buffers(label)[0]
        raw = t.narrow(axis, page, 1).view(torch.uint8)
        raw[(0,) * raw.dim()] ^= 0xFF
        rank.finish(3, out, "flipped")
        assert (rank.wrong, rank.checked) == (1, 2 * (3 + side)), label
    finally:
        rank.close()
