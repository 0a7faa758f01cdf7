"""hicache_mp through SGLang 0.5.23's real storage stack on CPU: the real
`MHATokenToKVPoolHost` on the "shm" allocator, the real `HiCacheController`
with its own prefetch/backup threads, the backend made by SGLang's
`StorageBackendFactory` (and wrapped by its `HiCacheStorageFailureInjector`),
driven by scripts/sglang_stack.py as SGLang's scheduler drives it.

Reaches inside: SGLang's `HiCacheController._stop_storage_threads` (its only
call that stops the storage threads and leaves the backend for the test to
close: the public detach_storage_backend() would close it too but swallow
close()'s errors, which the node-budget test must see).
"""
import os

import pytest


from hicache_mp.bench.sglang import real as sglang_real  # noqa: E402

try:
    SGL = sglang_real.import_stack()
except ImportError as exc:
    pytest.skip(f"SGLang's host-pool/controller chain is not importable ({exc}); install "
                f"`pip install --no-deps -r .ci/sglang-requirements.txt`", allow_module_level=True)

from hicache_mp.bench.sglang import stack as sglang_stack  # noqa: E402

import early  # noqa: E402  (tests/early.py: also runs this module's node split)

SMALL = early.STACK_SMALL


def test_real_stack_moves_exact_bytes(tmp_path):
    res = sglang_stack.main([*SMALL, "--runs", "1", "--inject-rounds", "0", "--trace-runs", "1",
                             "--sleep-floor", "--store", str(tmp_path),
                             "--json", str(tmp_path / "r.json")])
    b = {r["backend"]: r for r in res["backends"]}
    assert set(b) == {"nobytes", "mp", "file"}
    for name in ("mp", "file"):
        r = b[name]
        assert r["write_ok"] and r["read_with_write_ok"] and r["write_during_read_ok"], r
        # warm-up + idle + busy + a traced idle and busy + the read during a
        # write: every page compared
        assert r["checked_pages"] == 6 * r["pages"] and r["wrong_pages"] == 0, r
        assert "short_reads" not in r
    # hicache_mp took SGLang's zero-copy v1 path; file the generic one
    assert b["mp"]["calls"]["batch_get_v1"] > 0 and b["mp"]["calls"]["batch_get"] == 0
    assert b["file"]["calls"]["batch_get"] > 0 and b["file"]["calls"]["batch_get_v1"] == 0
    assert res["summary"]["wrong_pages"] == 0
    # the engine's sleeps per batch (GIL hand-backs) are measured and printed
    w = b["mp"]["wakeups_per_batch_get"]
    assert w["posted"] >= 0 and w["timeout_5ms"] >= 0 and "wakeups_per_batch_get" not in b["file"]
    # the GIL tracer saw SGLang's threads call the backend, per round and call
    trace = res["gil_trace"]
    assert trace["mp:busy"]["by_call"]["batch_get_v1"]["calls"] >= 1
    assert trace["nobytes-floor:busy"]["by_call"]["batch_get_v1"]["calls"] >= 1
    assert res["summary"]["mp_own_ms_per_batch_get"] is not None
    # the sleeping floor ran beside mp's rounds, sleeping per batch what mp's
    # idle batch took in that run, and its own figures are given beside mp's
    assert trace["sleep-floor:busy"]["by_call"]["batch_get_v1"]["calls"] >= 1
    assert b["mp"]["sleep_floor_sleep_s"][0] > 0
    assert res["summary"]["sleep_floor_busy_over_idle"] > 0
    assert res["summary"]["mp_own_ms_per_batch_get_beyond_sleep_floor"] is not None
    assert (tmp_path / "r.json").stat().st_size > 0
    assert not list(tmp_path.glob("hicache_mp-stack-*")), "the stores are removed"


def test_failure_injector_rounds_end_with_exact_prefixes(tmp_path):
    """Under SGLang's own injector (random failures and delays on every backend
    call) every round ends, and the pages a read reports landed are exact."""
    args = sglang_stack.parse([*SMALL, "--inject-rounds", "6", "--inject-failure", "0.4",
                               "--inject-delay", "0.002"])
    out = sglang_stack.injector_run(SGL, args, str(tmp_path))
    assert out["wrapped"] == "HiCacheStorageFailureInjector"
    assert len(out["read_tokens"]) == 6
    assert out["wrong_pages"] == 0
    assert out["checked_pages"] == sum(out["read_tokens"]) // args.page_size
    full = args.round_pages * args.page_size
    assert all(0 <= t <= full for t in out["read_tokens"] + out["write_tokens"])


def test_tp_ranks_share_the_node_budget(tmp_path, monkeypatch):
    """A TP-4 server's rank takes its quarter of the node's auto worker budget
    from the moment it starts, before the other ranks have registered."""
    from hicache_mp.engine.nodebudget import NODE_CORES_ENV, NODE_DIR_ENV, live_shares
    node = str(tmp_path / "node")
    monkeypatch.setenv(NODE_DIR_ENV, node)
    monkeypatch.setenv(NODE_CORES_ENV, "16")
    hp = sglang_real.mha_host_pool(SGL, layers=2, heads=4, head_dim=64, page_size=4, pages=8)
    ctl = sglang_real.controller(SGL, hp, backend="dynamic", tp_rank=1, tp_size=4,
                                 extra=sglang_real.mp_extra(str(tmp_path / "store")))
    try:
        # (16 - 2 for each of 4 schedulers' processes) // 4
        assert ctl.storage_backend.engine.metrics()["workers"] == 2
        assert list(live_shares(node, prune=False).values()) == [2]
    finally:
        ctl._stop_storage_threads()
        ctl.storage_backend.close()
        for fd in hp.allocator.fds:
            os.close(fd)
        hp.allocator.fds = []
    assert not os.path.exists(node)


def test_ranks_in_separate_processes_split_the_node():
    """scripts/sglang_ranks.py: a lone rank, then two concurrent ranks, each
    its own process with SGLang's controller; on a node of 8 cores the lone
    rank takes 7 and the two 3 each (8 - 1 x 2 for the schedulers' processes,
    halved: one core each at 8 CPUs or fewer, decision 89), every page exact."""
    # Run as `scripts/sglang_ranks.py --ranks 2 SMALL --runs 1 --json ...` with
    # HICACHE_MP_NODE_CORES=8 and a node directory of its own, started with the
    # session where it could (tests/early.py, "sglang_ranks").
    import json
    with early.finished("sglang_ranks") as (run, rcs, errs):
        assert rcs == [0], errs
        with open(run.path("ranks.json")) as f:
            res = json.load(f)
    assert res["lone"]["workers"] == 7
    assert [r["workers"] for r in res["together"]] == [3, 3]
    assert res["check"]["within_cores"] and res["check"]["wrong_pages"] == 0
    assert res["check"]["checked_pages"] > 0
