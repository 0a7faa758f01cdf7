"""The node-wide worker budget: engines with auto workers, each in its own
process, share the cores less one or two per scheduler's process (decision 89); a dead engine's share
is freed; nothing is left in the registry directory."""
import os
import signal
import subprocess
import sys

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


def test_explicit_workers_do_not_register(node, store):
    eng = PrefetchEngine(EngineConfig(storage_dir=store, num_workers=1, host_pool_pages=8), GEO)
    try:
        assert not os.path.exists(node)
    finally:
        eng.close()


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
