"""scripts/sglang_hybrid_check.py on a tiny geometry: SGLang's real KV and Mamba
host pools, mp and file, idle and busy; every hit complete, every page exact."""
import os

import pytest

import sglang_real_hybrid  # noqa: E402

try:
    sglang_real_hybrid.load()
except Exception as exc:  # ImportError, or a broken module on the chain
    pytest.skip(f"SGLang's host-pool classes cannot be imported here ({exc}); install "
                f"`pip install --no-deps -r .ci/sglang-stack-requirements.txt`",
                allow_module_level=True)

import sglang_hybrid_check  # noqa: E402

TINY = ["--rounds", "2", "--prefix-pages", "6", "--attn-layers", "2", "--mamba-layers", "2",
        "--kv-heads", "2", "--head-dim", "32", "--page-size", "8", "--temporal", "2,8,8",
        "--conv", "32,3", "--runs", "1", "--workers", "1"]


def test_hybrid_prefetch_is_byte_exact_on_both_backends(tmp_path):
    res = sglang_hybrid_check.main([*TINY, "--store", str(tmp_path),
                                    "--json", str(tmp_path / "h.json")])
    assert res["wrong_pages"] == 0
    assert set(res["backends"]) == {"mp", "file"}
    for r in res["backends"].values():
        assert set(r["modes"]) == {"idle", "busy"}
        assert all(m["gbps"] > 0 for m in r["modes"].values())
        # the GIL figures: gaps only where a busy loop ran, blocks in both modes
        assert r["modes"]["idle"]["gil_gaps_per_round"] is None
        assert r["modes"]["busy"]["gil_gaps_per_round"] >= 0
        assert r["modes"]["busy"]["gil_gap_ms_per_round"] >= 0
        assert all(m["storage_blocks_per_round"] >= 0 for m in r["modes"].values())
    mp = res["backends"]["mp"]["metrics"]
    assert mp["sidecar_pools"]["mamba"]["batched"] and mp["sidecar_unserved"] == {}
    assert mp["sidecar_pools"]["mamba"]["zero_copy"] and mp["sidecar_pools"]["mamba"]["parts"] == 2
    assert os.path.getsize(tmp_path / "h.json") > 0
