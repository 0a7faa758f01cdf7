"""Workload matches the reference workload's figures (docs/design.md §5); summary arithmetic is exact."""

import re

import numpy as np
import pytest

from hicache_mp.bench.sim.summary import (RequestResult, format_comparison,
                                    format_summary, summarize)
from hicache_mp.bench.sim.workload import (HIT_RATE, OUTPUT_MEAN, OUTPUT_P90,
                                     OUTPUT_P99, PROMPT_MEAN, PROMPT_P90,
                                     PROMPT_P99, ComputeModel, describe,
                                     make_workload)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_workload_matches_reference_figures(seed):
    reqs = make_workload(seed=seed)
    d = describe(reqs)
    assert len(reqs) == 32
    assert d["prompt_len_mean"] == pytest.approx(PROMPT_MEAN, rel=0.01)
    assert d["prompt_len_p90"] == pytest.approx(PROMPT_P90, rel=0.05)
    assert d["prompt_len_p99"] == pytest.approx(PROMPT_P99, rel=0.05)
    assert d["output_len_mean"] == pytest.approx(OUTPUT_MEAN, rel=0.01)
    assert d["output_len_p90"] == pytest.approx(OUTPUT_P90, rel=0.05)
    assert d["output_len_p99"] == pytest.approx(OUTPUT_P99, rel=0.05)
    assert abs(d["hit_rate"] - HIT_RATE) <= 0.01
    for r in reqs:
        assert r.output_len >= 1
        assert r.cached_len % 64 == 0 and 0 <= r.cached_len < r.prompt_len
        assert r.arrival_s == pytest.approx(r.rid / 24.0)


def test_deterministic_per_seed():
    assert make_workload(seed=5) == make_workload(seed=5)
    a = [r.prompt_len for r in make_workload(seed=5)]
    b = [r.prompt_len for r in make_workload(seed=6)]
    assert a != b


@pytest.mark.parametrize("scale", [0.1, 0.05])
def test_scale_keeps_hit_rate_and_scales_mean(scale):
    reqs = make_workload(scale=scale)
    d = describe(reqs)
    assert d["prompt_len_mean"] == pytest.approx(PROMPT_MEAN * scale, rel=0.01)
    assert abs(d["hit_rate"] - HIT_RATE) <= 0.01
    assert min(r.prompt_len for r in reqs) >= 128


def test_page_keys_unique_and_hex():
    reqs = make_workload(scale=0.1)
    cached = [k for r in reqs for k in r.page_keys(64)]
    computed = [k for r in reqs for k in r.computed_page_keys(64)]
    assert len(cached) == sum(r.cached_len // 64 for r in reqs)
    assert len(computed) == sum(r.prompt_len // 64 - r.cached_len // 64 for r in reqs)
    assert len(set(cached + computed)) == len(cached) + len(computed)
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in cached + computed)
    # Same request rebuilt gives the same keys (the store was warmed by them).
    assert reqs[3].page_keys(64) == make_workload(scale=0.1)[3].page_keys(64)


def test_compute_model_time_scale():
    m = ComputeModel(time_scale=0.5)
    assert m.prefill_s(11500) == pytest.approx(0.5)
    assert m.decode_s(10) == pytest.approx(0.075)


def _three():
    return [
        RequestResult(0, 1000, 2, 500, 1.0, [0.1], 1.1),
        RequestResult(1, 2000, 3, 1500, 2.0, [0.1, 0.2], 2.3),
        RequestResult(2, 3000, 4, 2500, 4.0, [0.3, 0.1, 0.5], 4.9),
    ]


def test_summarize_exact():
    s = summarize(_three(), duration_s=10.0)
    expected = {
        "total_requests": 3,
        "prompt_len_mean": 2000, "prompt_len_p90": 2800, "prompt_len_p99": 2980,
        "output_len_mean": 3, "output_len_p90": 3.8, "output_len_p99": 3.98,
        "ttft_mean_s": 7 / 3, "ttft_p90_s": 3.6, "ttft_p99_s": 3.96,
        "ttft_median_s": 2.0, "ttft_max_s": 4.0,
        "itl_mean_s": 1.3 / 6, "itl_p90_s": 0.4, "itl_p99_s": 0.49,
        "itl_median_s": 0.15, "itl_max_s": 0.5,
        "latency_mean_s": 8.3 / 3, "latency_p90_s": 4.38, "latency_p99_s": 4.848,
        "latency_median_s": 2.3, "latency_max_s": 4.9,
        "input_token_throughput": 600.0, "output_token_throughput": 0.9,
        "request_throughput": 0.3, "cache_hit_rate": 0.75,
    }
    assert set(s) == set(expected)
    for k, v in expected.items():
        assert s[k] == pytest.approx(v), k


def test_format_summary_and_comparison():
    s = summarize(_three(), duration_s=10.0)
    text = format_summary("file", s, {"prefetch_gbps_mean": 1.5, "backup_gbps": None})
    assert "Serving Benchmark Result (file)" in text and "Prefetch GB/s" in text
    fast = dict(s, ttft_mean_s=s["ttft_mean_s"] / 2, loop_iters_per_s=1234.0)
    table = format_comparison({"stock": s, "mp": fast, "empty": {}}, baseline="stock")
    lines = table.splitlines()
    for name in ("stock", "mp", "empty"):
        assert any(l.startswith(name) for l in lines)
    stock = next(l for l in lines if l.startswith("stock")).split()
    mp = next(l for l in lines if l.startswith("mp")).split()
    assert stock[-2:] == ["1.00", "2.00"]
    assert mp[-2:] == ["0.50", "1.00"]
    assert "-" in next(l for l in lines if l.startswith("empty")).split()
