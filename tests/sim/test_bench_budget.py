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


def test_an_explicit_count_above_the_budget_is_warned_of_once_and_reported(tmp_path):
    """A bench run makes two mp engines with the same count (the warm-up's, then
    the run's): one warning, not two. The report says the budget, where it
    came from, and that the count was the user's."""
    env = dict(os.environ, **{NODE_CORES_ENV: "2", "HICACHE_MP_NODE_DIR": str(tmp_path / "n")})
    out = cli_run("bench", "--quick", "--num-requests", "2", "--hicache-storage-backend", "mp",
                  "--hicache-mp-workers", "3", "--storage-dir", str(tmp_path / "s"),
                  "--json", str(tmp_path / "r.json"), env=env)
    assert out.returncode == 0, out.stderr
    warned = [ln for ln in out.stderr.splitlines() if "above this process's CPU budget" in ln]
    assert len(warned) == 1 and "num_workers=3" in warned[0], out.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    budget, engine = rep["cpu_budget"], rep["runs"]["mp"]["engine"]
    expect = read_budget(environ={NODE_CORES_ENV: "2"})
    assert budget["workers"] == engine["workers"] == 3
    assert budget["workers_setting"] == "explicit"
    assert (budget["cpus"], budget["bound_by"], budget["source"]) == \
        (expect.cpus, expect.bound_by, expect.source)
    assert budget["override"] is True and budget["host_cores"] == 2
    assert engine["cpu"]["cpus"] == expect.cpus and "throttle" in engine["cpu"]
