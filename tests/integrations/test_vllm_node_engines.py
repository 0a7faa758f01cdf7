"""The vLLM tier's auto workers on a node of several vLLM replicas, through
vLLM's real TieringOffloadingSpec (its SharedOffloadRegion, its factory).

vLLM builds its tiers in the scheduler's process, once per data-parallel
replica (TP/PP workers build none), so a replica is one engine: the tier
passes vLLM's data-parallel size as node_engines, as SGLang's adapter passes
its ranks, and the replicas split the node's CPUs whichever starts first."""
import contextlib
import dataclasses
import importlib.util
import os
import uuid

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed; install it with "
                "`pip install --no-deps -r .ci/vllm-requirements.txt`", allow_module_level=True)

from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from hicache_mp.bench.vllm.tier import offloading_config  # noqa: E402
from hicache_mp.engine.cpubudget import read_budget  # noqa: E402
from hicache_mp.engine.nodebudget import NODE_CORES_ENV, NODE_DIR_ENV  # noqa: E402

OURS = {"type": "HiCacheMPTier", "module_path": "hicache_mp.integrations.vllm"}


@contextlib.contextmanager
def replica(tier: dict, *, dp_size: int = 1, dp_index: int = 0):
    """One vLLM replica's tier (data-parallel replica `dp_index` of `dp_size`),
    built by vLLM's own spec and manager; shut down on exit."""
    engine_id = f"hicache-test-{uuid.uuid4().hex[:8]}_dp{dp_index}"
    config = offloading_config(engine_id, 64 << 10, 8, [tier])
    config = dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, data_parallel_size=dp_size, data_parallel_index=dp_index))
    manager = TieringOffloadingSpec(config).get_manager()
    try:
        yield manager.secondary_tiers[0]
    finally:
        manager.shutdown()
        with contextlib.suppress(FileNotFoundError):  # vLLM unlinks it; never leave it
            os.unlink(f"/dev/shm/vllm_offload_{engine_id}.mmap")


def test_data_parallel_replicas_split_the_node_from_the_start(store, tmp_path, monkeypatch):
    """4 CPUs, one kept per replica's scheduler: one replica alone runs 3
    workers; of two replicas the first started runs 1, not 3 as if alone
    (leaving the second above the budget), and so does the second. The
    tier's node_engines key wins over vLLM's count."""
    monkeypatch.setenv(NODE_CORES_ENV, "4")
    monkeypatch.setenv(NODE_DIR_ENV, str(tmp_path / "node"))  # this test's node only
    if read_budget().cpus != 4:
        pytest.skip(f"this process may use fewer than 4 CPUs ({read_budget().source})")
    auto = {**OURS, "storage_dir": store, "num_workers": 0}
    with replica(auto) as alone:
        assert alone.engine.config.node_engines == 1 and alone.engine.worker_count() == 3
    with replica(auto, dp_size=2, dp_index=0) as first:
        assert first.engine.config.node_engines == 2
        assert first.engine.worker_count() == 1     # the other replica not started yet
        with replica(auto, dp_size=2, dp_index=1) as second:
            assert second.engine.worker_count() == 1
            assert first.region.path != second.region.path
    with replica({**auto, "node_engines": 1}, dp_size=2) as told:
        assert told.engine.worker_count() == 3
    assert not os.path.exists(tmp_path / "node")
