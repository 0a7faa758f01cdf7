"""The node-wide worker budget: engines with auto workers, each in its own
process, share the cores less one or two per scheduler's process (decision 89); a dead engine's share
is freed; nothing is left in the registry directory."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from hicache_mp import EngineConfig, PrefetchEngine
from hicache_mp.engine.nodebudget import NODE_CORES_ENV, NODE_DIR_ENV, NodeBudget, budget_share, \
    live_shares
from shm import PageGeometry

GEO = PageGeometry(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4)


@pytest.fixture
def node(tmp_path, monkeypatch):
    d = str(tmp_path / "node")
    monkeypatch.setenv(NODE_DIR_ENV, d)
    return d


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A child registers (a bare share, or a whole engine), prints its worker count,
# and holds it until its stdin closes.
SHARE = """
import sys; sys.path.insert(0, sys.argv[1])
from hicache_mp.engine.nodebudget import NodeBudget
share = NodeBudget(int(sys.argv[2]), cores=int(sys.argv[3]))
print(share.workers, flush=True); sys.stdin.read(); share.close()
"""
ENGINE = """
import sys; sys.path.insert(0, sys.argv[1])
from hicache_mp import EngineConfig, PrefetchEngine
from shm import PageGeometry
eng = PrefetchEngine(EngineConfig(storage_dir=sys.argv[3], num_workers=0,
                                  node_engines=int(sys.argv[2]), host_pool_pages=8),
                     PageGeometry(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4))
print(eng.metrics()["workers"], flush=True); sys.stdin.read(); eng.close()
"""


def child(code, *args):
    p = subprocess.Popen([sys.executable, "-c", code, ROOT, *map(str, args)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip().isdigit(), f"child failed: {line!r}"
    return p, int(line)


def release(procs):
    for p in procs:
        if p.poll() is None:
            p.stdin.close()
    for p in procs:
        p.wait(30)


def test_budget_share():
    assert budget_share(32, 1, 0) == 30
    assert budget_share(32, 2, 0) == 14 and budget_share(32, 2, 14) == 14
    assert budget_share(32, 4, 12) == 6
    assert budget_share(128, 8, 0) == 14
    # a late, unannounced engine gets what is left, and always one
    assert budget_share(32, 2, 31) == 1
    assert budget_share(2, 2, 0) == 1


def test_shares_across_processes_and_a_dead_engine_frees_its_share(node):
    procs = []
    try:
        for _ in range(3):  # one after another: each sees the others registered
            p, workers = child(SHARE, 3, 16)
            procs.append(p)
            assert workers == 3  # (16 cores - 2 for each of 3 schedulers) // 3
        shares = live_shares(node, prune=False)
        assert len(shares) == 3 and sum(shares.values()) + 2 * 3 <= 16

        os.kill(procs[1].pid, signal.SIGKILL)  # its share must come back
        procs[1].wait(10)
        late = NodeBudget(0, directory=node, cores=16)  # not announced by node_engines
        try:
            assert late.engines == 3 and late.workers == 3
            assert len(os.listdir(node)) == 3  # the dead engine's entry was removed
        finally:
            late.close()
    finally:
        release(procs)
    assert not os.path.exists(node), "the registry directory goes with its last engine"


def test_engines_in_separate_processes_share_the_node(node, store, monkeypatch):
    """Two engines with auto workers on a node of 10 cores: 3 workers each
    (10 - 2 x 2 for the schedulers' processes, halved), not 9 each."""
    monkeypatch.setenv(NODE_CORES_ENV, "10")
    procs = []
    try:
        for _ in range(2):
            p, workers = child(ENGINE, 2, store)
            procs.append(p)
            assert workers == 3
        assert sorted(live_shares(node, prune=False).values()) == [3, 3]
    finally:
        release(procs)
    assert all(p.returncode == 0 for p in procs)
    assert not os.path.exists(node)


def test_an_explicit_count_registers_and_a_later_auto_engine_counts_it(node):
    """Decision 98: 5 explicit workers on 8 cores leave an auto engine one
    (8 - 1 per scheduler x 2 - 5), not the 7 it would take alone."""
    shares = []
    try:
        shares.append(NodeBudget(0, directory=node, cores=8, explicit=5))
        assert shares[0].workers == 5 and shares[0].registered
        assert list(live_shares(node, prune=False).values()) == [5]
        shares.append(NodeBudget(0, directory=node, cores=8))
        assert shares[1].workers == 1 and shares[1].engines == 2
        assert shares[1].floored() is False   # 1 was left: no floor
        assert shares[0].over_by() == 0 and shares[1].over_by() == 0
        shares.append(NodeBudget(0, directory=node, cores=8))
        assert shares[2].workers == 1 and shares[2].floored()   # nothing was left
        # 5 + 1 workers and 3 schedulers are 9 of 8 CPUs; with its own worker, 10
        assert shares[2].over_by() == 2
    finally:
        for s in shares:
            s.close()
    assert not os.path.exists(node)


def test_explicit_engines_over_their_shared_budget_are_warned_of(node, store, monkeypatch,
                                                                  caplog):
    """Two engines of 2 explicit workers each on 4 CPUs: each fits alone (3
    beside its scheduler), together they do not (4 - 2 schedulers = 2). The
    second engine says so, naming what the others run."""
    monkeypatch.setenv(NODE_CORES_ENV, "4")
    caplog.set_level("INFO", logger="hicache_mp")
    first = PrefetchEngine(EngineConfig(storage_dir=store, num_workers=2, host_pool_pages=8), GEO)
    try:
        assert not [r for r in caplog.records if "CPU budget" in r.getMessage()]
        assert sorted(live_shares(node, prune=False).values()) == [2]
        second = PrefetchEngine(EngineConfig(storage_dir=store, num_workers=2,
                                             host_pool_pages=8), GEO)
        try:
            assert second.worker_count() == 2   # the user's count stands
            warned = [r.getMessage() for r in caplog.records
                      if "above this process's CPU budget" in r.getMessage()]
            assert len(warned) == 1, warned
            assert "num_workers=2" in warned[0] and "already run 2 workers" in warned[0]
            assert "4 CPU(s) (HICACHE_MP_NODE_CORES=4)" in warned[0]
            assert "1 kept for each of 2 engines' schedulers" in warned[0]
        finally:
            second.close()
    finally:
        first.close()
    assert not os.path.exists(node)


def test_a_budget_warning_is_given_once_per_cause_in_a_process(node, store, monkeypatch,
                                                              caplog):
    """An engine made again as the one before it (the bench's warm-up engine,
    then its run's) has the same cause: its words go to INFO, not a second
    warning. Another count is another cause, and a warning again. (3 CPUs,
    a count no other test uses: the words are this test's own.)"""
    monkeypatch.setenv(NODE_CORES_ENV, "3")
    caplog.set_level("INFO", logger="hicache_mp")

    def said(workers):
        caplog.clear()
        PrefetchEngine(EngineConfig(storage_dir=store, num_workers=workers,
                                    host_pool_pages=8), GEO).close()
        return [(r.levelname, r.getMessage()) for r in caplog.records
                if "above this process's CPU budget" in r.getMessage()]

    first, again, other = said(3), said(3), said(4)
    assert [lvl for lvl, _ in first + again + other] == ["WARNING", "INFO", "WARNING"]
    assert again[0][1] == first[0][1] + " (as warned before in this process)"
    assert "num_workers=3" in first[0][1] and "num_workers=4" in other[0][1]
    assert not os.path.exists(node)


def test_auto_says_what_it_chose_and_warns_where_no_cpu_is_left(node, store, monkeypatch,
                                                                caplog):
    """Four announced engines (node_engines=4, SGLang's TP ranks) on 4 CPUs:
    one core each for the schedulers leaves none; the engine runs one worker
    and says it is above the budget. On 10 CPUs alone it says what it chose."""
    caplog.set_level("INFO", logger="hicache_mp")
    monkeypatch.setenv(NODE_CORES_ENV, "4")
    eng = PrefetchEngine(EngineConfig(storage_dir=store, num_workers=0, node_engines=4,
                                      host_pool_pages=8), GEO)
    try:
        assert eng.worker_count() == 1
    finally:
        eng.close()
    msgs = [r.getMessage() for r in caplog.records]
    floor = [m for m in msgs if "no CPU is left" in m]
    assert len(floor) == 1 and "Raise the CPU limit" in floor[0], msgs
    caplog.clear()
    monkeypatch.setenv(NODE_CORES_ENV, "10")
    with PrefetchEngine(EngineConfig(storage_dir=store, num_workers=0, host_pool_pages=8),
                        GEO) as eng:
        assert eng.worker_count() == 8
    said = [r for r in caplog.records if "I/O worker(s) (auto)" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO"]
    assert "8 I/O worker(s) (auto), from 10 CPU(s) (HICACHE_MP_NODE_CORES=10), 2 kept for " \
        "the scheduler" in said[0].getMessage()
    assert not os.path.exists(node)


def test_auto_never_asks_for_more_workers_than_an_engine_may_have():
    """A host of 1,000 cores (a 2 x 192-core node is past 256 already): auto
    takes the most an engine may run, where it used to fail with
    `num_workers=998: 1 to 256`, a setting the user never gave."""
    from workers.control import MAX_WORKERS
    assert budget_share(1000, 1, 0) == MAX_WORKERS == 256
    assert budget_share(1000, 2, 0) == 256 and budget_share(600, 2, 256) == 256


def test_an_unusable_registry_names_the_variable_and_an_explicit_count_runs_without_it(
        tmp_path, store, monkeypatch):
    """HICACHE_MP_NODE_DIR on a file (a hostPath mounted wrong): auto is refused
    before any worker, with the variable and the ways out; an explicit count,
    which needs no share, runs."""
    bad = tmp_path / "a-file"
    bad.write_text("")
    monkeypatch.setenv(NODE_DIR_ENV, str(bad / "node"))
    with pytest.raises(OSError, match=f"{NODE_DIR_ENV}.*num_workers"):
        PrefetchEngine(EngineConfig(storage_dir=store, num_workers=0, host_pool_pages=8), GEO)
    with PrefetchEngine(EngineConfig(storage_dir=store, num_workers=1, host_pool_pages=8),
                        GEO) as eng:
        eng.backup([b"k"], np.array([0]))
        assert eng.worker_count() == 1
    assert bad.read_text() == ""


def test_bad_core_override_is_refused_before_any_worker(node, store, monkeypatch):
    monkeypatch.setenv(NODE_CORES_ENV, "many")
    with pytest.raises(ValueError, match=NODE_CORES_ENV):
        PrefetchEngine(EngineConfig(storage_dir=store, num_workers=0, host_pool_pages=8), GEO)
    assert not os.path.exists(node)


def test_auxiliary_engines_take_from_the_budget_but_are_no_schedulers(node):
    """A hybrid model's sidecar engines (aux_cap) live in their rank's process:
    their workers count as taken, but they add no scheduler to the count."""
    shares = []
    try:
        def share(**kw):
            shares.append(NodeBudget(2, directory=node, cores=12, **kw))
            return shares[-1].workers

        assert share() == 4                  # rank 0's KV engine: (12 - 2 x 2) // 2
        assert share(aux_cap=2) == 2         # its Mamba engine: 4 of the 8 are free
        assert shares[-1].engines == 2       # ... and it is no third scheduler
        assert share() == 2                  # rank 1's KV engine: what is left
        assert share(aux_cap=2) == 1         # none left: still one, never none
        live = live_shares(node, prune=False)
        assert sorted(live.values()) == [1, 2, 2, 4]
        late = NodeBudget(0, directory=node, cores=12)   # 2 schedulers, not 4
        shares.append(late)
        assert late.engines == 3
    finally:
        for s in shares:
            s.close()
    assert not os.path.exists(node)


def test_a_share_refused_before_registering_leaves_no_entry(node):
    """The engine's room check runs with the share decided and nothing registered:
    an engine too large for /dev/shm leaves no entry counting against later ones."""
    seen = []

    def refuse(workers):
        seen.append(workers)
        raise ValueError("does not fit")

    with pytest.raises(ValueError, match="does not fit"):
        NodeBudget(0, directory=node, cores=16, before_register=refuse)
    assert seen == [14]
    assert live_shares(node) == {} and not os.path.exists(node)
    later = NodeBudget(0, directory=node, cores=16)
    try:
        assert later.workers == 14          # not squeezed by the refused engine
    finally:
        later.close()
