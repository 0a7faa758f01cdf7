"""The mp-direct run: SGLang's direct L3 path in the reference scheduler, with
real engines (a whole-page writer, a layer-group reader), real workers, a
real store and the linker's device copies into CPU planes.

What a user of the main job would notice: every request served with the
workload's hits and exact bytes, the forward of a request's first chunk
starting before its prefix has finished loading (the point of the path),
TTFT parts that still sum to the TTFT, the device rows holding the page
bytes, and a bad --layer-groups refused before any store or worker exists.
"""
import numpy as np
import pytest
import torch

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from hicache_mp.bench.sim.bench import DIRECT, Bench, BenchConfig
from hicache_mp.bench.sim.direct import DirectLoads, device_planes
from hicache_mp.bench.sim.pagebytes import PageBytes
from hicache_mp.bench.sim.workload import describe

N = 4
GROUPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = BenchConfig(runs=("none", DIRECT), num_requests=N, quick=True, prompt_scale=0.05,
                      storage_dir=str(tmp_path_factory.mktemp("direct") / "store"),
                      max_run_s=60.0, layer_groups=GROUPS, device_load="on")
    bench = Bench(cfg, log=lambda m: None)
    results = {}
    report = bench.run(on_result=lambda label, res, figs: results.__setitem__(label, res))
    return bench, report, results


def test_every_request_is_served_with_its_hits_and_exact_bytes(run):
    bench, report, results = run
    d = report["runs"][DIRECT]
    assert d["summary"]["total_requests"] == N
    assert d["summary"]["cache_hit_rate"] == pytest.approx(describe(bench.requests)["hit_rate"])
    # every request's first page checked, each layer group in its own slot
    assert d["verify"] == {"pages_checked": N, "failures": []}
    # one read op per layer group per request, every page of each landed
    assert d["prefetch"]["statuses"] == {"ok": N * GROUPS}
    hit_pages = sum(r["cached_len"] for r in d["requests"]) // bench.cfg.page_size
    assert d["engine"]["read_bytes"] == hit_pages * bench.geometry.page_bytes


def test_a_first_chunk_computes_while_its_prefix_still_loads(run):
    """The first prefill batch starts when the request is ready, before the
    read of its last layer group is done; its end waited for that group."""
    _bench, _report, results = run
    res = results[DIRECT]
    first = next(b for b in res.batches if b[0] == "prefill")
    ops0 = [r for r in res.prefetch if r.rid == 0]
    assert len(ops0) == GROUPS
    last_done_s = max(r.done_ns for r in ops0) / 1e9 - res.t0_ns / 1e9
    assert first[1] < last_done_s <= first[2]


def test_ttft_parts_sum_to_the_ttft_with_the_layer_wait(run):
    from hicache_mp.bench.sim.ttftparts import PART_NAMES
    _bench, report, _results = run
    for label, d in report["runs"].items():
        for r in d["requests"]:
            parts = r["ttft_parts"]
            assert tuple(parts) == PART_NAMES and min(parts.values()) >= 0
            assert sum(parts.values()) == pytest.approx(r["ttft_s"], abs=1e-9), (label, r["rid"])
            # no host tier: no read before the first chunk, in either run
            assert parts["first_page"] == parts["read"] == parts["h2d"] == 0.0, label
    assert report["runs"]["none"]["ttft_parts"]["mean_s"]["layer_wait"] == 0.0


def test_layer_groups_land_in_the_device_rows_byte_for_byte(tmp_path):
    g = PageGeometry(num_layers=4, num_kv_heads=2, head_dim=16, page_size=4, dtype="bfloat16")
    gen, keys = PageBytes(g, seed=3), ["a", "b", "c"]
    cfg = dict(storage_dir=str(tmp_path), model_name="direct")
    with PrefetchEngine(EngineConfig(host_pool_pages=3, num_workers=1, **cfg), g) as w:
        for slot, key in enumerate(keys):
            gen.fill(w.host_pool, slot, key)
        assert w.wait(w.backup(keys, range(3))) is True
    with PrefetchEngine(EngineConfig(host_pool_pages=GROUPS * 4, num_workers=1, read_parts=GROUPS,
                                     **cfg), g) as r:
        planes = device_planes(g, 5, "cpu")
        loads = DirectLoads(r, GROUPS, g.page_size, planes, "cpu", device_pages=5)
        loads.start(0, ["zz"])       # a page not there: its groups fail, nothing is copied
        load = loads.start(1, keys)
        assert loads.start(2, keys) is None   # 3 x 2 slots of 8 are taken: no room
        for _ in range(2000):
            loads.poll(0.0)
            if not loads.loading:
                break
            r.wait(load.ops[-1], 0.01)
        assert not loads.loading and not load.failed
        rows = load.tokens.view(len(keys), g.page_size)
        for i, key in enumerate(keys):
            want = gen.expected(key).reshape(g.kv_count, g.num_layers, -1)
            for kv in range(g.kv_count):
                for layer in range(g.num_layers):
                    got = planes[kv][layer][rows[i]].contiguous().view(torch.uint8).numpy()
                    assert np.array_equal(got.ravel(), want[kv, layer]), (key, kv, layer)
        on = load.on_device_s = [1.0, 3.0]   # when the loop saw each group there
        assert loads.end_s(0.0, 4.0, [load]) == max(on[0] + 2.0, on[1]) + 2.0
        loads.release_slots(load)
        loads.release_device(load)
        loads.close()


@pytest.mark.parametrize("kw, says", [({"layer_groups": 3}, "--layer-groups 3"),
                                      ({"layout": "layer_first"}, "page_first")])
def test_a_bad_direct_setting_is_refused_before_any_store(tmp_path, kw, says):
    cfg = BenchConfig(runs=(DIRECT,), num_requests=2, quick=True, prompt_scale=0.05,
                      storage_dir=str(tmp_path / "store"), **kw)
    with pytest.raises(ValueError, match=says):
        Bench(cfg, log=lambda m: None)
    assert not (tmp_path / "store").exists()
