"""scripts/sglang_hybrid_check.py on tiny geometries: SGLang's real Mamba, SWA and
DSA host pools, mp with the no-bytes floor interleaved, idle and busy, the GIL
tracer's per-call table; every KV and sidecar page read is exact."""
import os

import pytest

import sglang_real_hybrid  # noqa: E402

try:
    sglang_real_hybrid.load()
except Exception as exc:  # ImportError, or a broken module on the chain
    pytest.skip(f"SGLang's host-pool classes cannot be imported here ({exc}); install "
                f"`pip install --no-deps -r .ci/sglang-stack-requirements.txt`",
                allow_module_level=True)

import torch  # noqa: E402

import sglang_hybrid_check  # noqa: E402
import sglang_hybrid_rank  # noqa: E402

TINY = ["--tiny", "--round-pages", "4", "--requests", "2", "--runs", "2", "--trace-runs", "1",
        "--workers", "1"]
GEOMS = ("mamba", "swa", "dsa")


def test_hybrid_harness_figures_floor_and_tracer(tmp_path):
    res = sglang_hybrid_check.main([*TINY, "--store", str(tmp_path),
                                    "--json", str(tmp_path / "h.json")])
    assert os.path.getsize(tmp_path / "h.json") > 0
    assert res["summary"]["wrong_pages"] == 0
    assert set(res["geometries"]) == set(GEOMS)
    for g in GEOMS:
        r = res["geometries"][g]["sizes"]["4"]
        assert r["wrong_pages"] == 0
        # every KV page and every sidecar page (1 Mamba state, 2 SWA pages, 4
        # indexer pages per request) of every mp run, timed, warm and traced
        side = {"mamba": 1, "swa": 2, "dsa": 4}[g]
        assert r["checked_pages"] == (1 + 2 * 2 + 2 * 1) * 2 * (4 + side)
        # SGLang's calls per request: one hit query, one KV batch, one v2 read
        assert r["calls_per_request"] == {"batch_exists_v2": 1.0, "batch_get_v1": 1.0,
                                          "batch_get_v2": 1.0}
        # the floor ran in the same run, run for run beside mp
        for k in ("mp", "nobytes"):
            assert len(r["runs_s"][f"{k}_idle"]) == len(r["runs_s"][f"{k}_busy"]) == 2
            assert r[f"{k}_loop_rate"] > 0
        assert len(r["own_ms_per_request_runs"]) == 2
        assert r["loop_rate_mp_over_floor"] > 0 and r["mp_idle_gbps"] > 0
        # the tracer saw SGLang's calls on the storage thread, per backend, mode and backup
        trace = res["gil_trace"]
        for kind in ("mp", "nobytes"):
            calls = trace[f"{g}-4:{kind}:busy"]["by_call"]
            for name in ("batch_exists_v2", "batch_get_v1", "batch_get_v2"):
                assert calls[name]["calls"] == 2, (g, kind, name)
                assert calls[name]["c_calls_over_1ms"] >= 0
            backup = trace[f"{g}-4:{kind}:backup-busy"]["by_call"]
            assert backup["batch_set_v2"]["calls"] == backup["batch_set_v1"]["calls"] == 1
        # the no-bytes backend moves nothing, so it sleeps nowhere
        nb = trace[f"{g}-4:nobytes:busy"]["by_call"]
        assert not any("wake.py" in site for c in nb.values() for site in c["sites"])
    assert any(row.startswith("| mamba-4:mp:busy | batch_get_v2 | 2 |")
               for row in res["gil_trace_table"])
    assert "mamba-4:mp:warm" not in " ".join(res["gil_trace_table"])


@pytest.mark.parametrize("geom", GEOMS)
def test_byte_check_finds_a_wrong_sidecar_page(geom, tmp_path):
    """The check compares every page: one flipped byte in a sidecar page read is one wrong page."""
    S = sglang_real_hybrid.load()
    import sglang.srt.mem_cache.hicache_storage as hs
    g = sglang_real_hybrid.geometry(geom, tiny=True)
    rank = sglang_hybrid_rank.Rank(S, hs, g, "mp", str(tmp_path), requests=1, max_pages=3,
                                   workers=1)
    try:
        assert rank.backup(3, 0)
        rank.clear_dst(3)
        assert rank.prefetch(3, 0) == 3
        rank.check(3)
        assert (rank.wrong, rank.checked) == (0, 3 + {"mamba": 1, "swa": 2, "dsa": 3}[geom])
        label, views = rank._views(sglang_hybrid_rank.DST, 0, 3)[1]
        raw = views[0].view(torch.uint8)
        raw[(-1,) * raw.dim()] ^= 0xFF
        rank.check(3)
        assert rank.wrong == 1, label
    finally:
        rank.close()
