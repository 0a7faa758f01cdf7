"""vLLM's real tiering stack on CPU, for tests and the tier bench.

`tiering(...)` builds vLLM's own TieringOffloadingSpec from a real
OffloadingConfig and calls its get_manager(): vLLM creates the CPU tier (its
SharedOffloadRegion: the mmap of /dev/shm/vllm_offload_<engine_id>.mmap), the
primary tier manager, and every secondary tier through SecondaryTierFactory,
exactly as in a server. Nothing here is a stand-in for a vLLM class. On exit
the manager is shut down (tiers, then the CPU tier, which unlinks its file).

Reaches inside: vLLM's secondary tier's `_primary_kv_view` (the memoryview of
the CPU tier's rows that vLLM hands every tier, set by its SecondaryTier base
class with no public getter): the tests fill and check rows through it.
"""
import contextlib
import os
import time
import uuid

import numpy as np

from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hicache_mp.bench.vllm.tier import offloading_config  # noqa: F401  (one builder for bench and tests)

OURS = {"type": "HiCacheMPTier", "module_path": "hicache_mp.integrations.vllm"}
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def region_path(engine_id: str) -> str:
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


@contextlib.contextmanager
def tiering(tiers: list, *, row_bytes: int = 64 << 10, rows: int = 32, engine_id=None,
            **extra):
    """(spec, manager) for vLLM's tiering with `tiers`; shut down on exit."""
    engine_id = engine_id or f"hicache-test-{uuid.uuid4().hex[:8]}"
    spec = TieringOffloadingSpec(offloading_config(engine_id, row_bytes, rows, tiers, **extra))
    manager = spec.get_manager()
    try:
        yield spec, manager
    finally:
        manager.shutdown()
        with contextlib.suppress(FileNotFoundError):  # vLLM unlinks it; never leave it
            os.unlink(region_path(engine_id))


def rows_of(tier) -> np.ndarray:
    """The tier's primary_kv_view as a writable uint8 array (no copy)."""
    return np.asarray(tier._primary_kv_view).view(np.uint8)


def key(n: int, group: int = 0):
    return make_offload_key(n.to_bytes(8, "big"), group)


def job(job_id: int, keys, rows, *, load: bool, req_id: str = "req") -> TransferJob:
    return TransferJob(job_id=job_id, keys=list(keys), chunk_ids=np.asarray(rows, np.int64),
                       is_promotion=load, req_context=ReqContext(req_id=req_id))


def fill(view: np.ndarray, rows, seed: int) -> np.ndarray:
    """Random bytes into `rows`; returns a copy of what was written."""
    data = np.random.default_rng(seed).integers(0, 256, (len(rows), view.shape[1]),
                                                dtype=np.uint8)
    view[np.asarray(rows)] = data
    return data


def finish(tier, job_ids, timeout_s: float = 30.0) -> dict:
    """Poll get_finished_jobs() (as vLLM's scheduler does, never blocking) until
    every job in `job_ids` has reported; {job_id: JobResult}."""
    want, got = set(job_ids), {}
    deadline = time.monotonic() + timeout_s
    while not want <= set(got):
        for result in tier.get_finished_jobs():
            assert result.job_id not in got, f"job {result.job_id} reported twice"
            got[result.job_id] = result
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {sorted(want - set(got))} never finished")
        time.sleep(0.001)
    return got


def resolve(tier, keys, ctx=None, timeout_s: float = 10.0) -> list:
    """lookup() each key, one scheduler step at a time (on_schedule_end between
    steps), until none answers RETRY; the final answers."""
    ctx = ctx or ReqContext(req_id="lookup")
    deadline = time.monotonic() + timeout_s
    while True:
        answers = [tier.lookup(k, ctx) for k in keys]
        if all(a.name != "RETRY" for a in answers) or time.monotonic() > deadline:
            return answers
        tier.on_schedule_end(STEP)
        tier.get_finished_jobs()  # polls the engine: probe answers land
        time.sleep(0.002)
