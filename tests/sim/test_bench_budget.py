"""`hicache-mp bench` and the CPU budget: its report says what the workers
were sized from and how (auto or the user's count), as the engine read it;
a warning of a count above the budget comes once per run, not once per engine."""
import json
import os

from hicache_mp import cli
from hicache_mp.engine.cpubudget import BOUNDS, NODE_CORES_ENV, read_budget

from test_cli_usage import cli_run


def test_the_report_says_the_budget_auto_sized_the_workers_from(tmp_path, monkeypatch):
    """The `none` run needs no engine: only the warm-up's is made (a second)."""
    monkeypatch.setenv("HICACHE_MP_NODE_DIR", str(tmp_path / "node"))  # this test's node only
    path = tmp_path / "r.json"
    assert cli.main(["bench", "--quick", "--num-requests", "1", "--hicache-storage-backend",
                     "none", "--storage-dir", str(tmp_path / "s"), "--json", str(path)]) == 0
    budget = json.loads(path.read_text())["cpu_budget"]
    expect = read_budget()
    assert (budget["cpus"], budget["bound_by"], budget["source"], budget["override"]) == \
        (expect.cpus, expect.bound_by, expect.source, False)
    assert budget["bound_by"] in BOUNDS and budget["workers_setting"] == "auto"
    assert 1 <= budget["workers"] <= expect.cpus
