"""scripts/bench_vllm_capacity.py --quick end to end: vLLM's real tiering classes, real
workers, a real evictor process and page files, under storage_max_bytes."""
import importlib.util
import json
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed; install it with "
                "`pip install --no-deps -r .ci/vllm-requirements.txt`", allow_module_level=True)


def test_capacity_bench_stays_under_the_limit_and_keeps_new_pages(tmp_path):
    # main() in this process: the suite imported vLLM at collection (test_vllm_tier),
    # and a child of its own spent ~5 s of the test importing it again
    from hicache_mp.bench.vllm import capacity as bench_vllm_capacity
    out = tmp_path / "capacity.json"
    assert bench_vllm_capacity.main(["--quick", "--gap-s", "0.25", "--eviction-interval-s", "0.1",
                                     "--store", str(tmp_path / "store"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    page = res["args"]["row_bytes"] + 4096
    assert res["written_bytes"] > 2 * res["limit_bytes"]
    # Disk use, temp files of writes in flight included (one a worker at most).
    assert res["peak_store_bytes"] <= res["limit_bytes"] + res["args"]["workers"] * page + 4096
    assert res["metrics"]["evicted_pages"] > 0
    # The evictor made room: more pages landed than the limit holds, the newest among them.
    assert sum(r["pages_written"] for r in res["rounds"]) > res["args"]["limit_rows"]
    assert res["last_round_load"]["rows_ok"] >= 1
    assert res["last_round_load"]["wrong_bytes"] == 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("vllm_offload_bench-")]
