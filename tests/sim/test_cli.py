"""`hicache-mp bench`: --help documents every flag; a small run prints the table and JSON.

Reaches inside: `cli._bench_parser` (the builder of the bench subcommand's
parser; the public build_parser() returns the top parser, whose subparsers
argparse gives no public way to) and argparse's `_actions` (a parser's
options, which argparse lists publicly only as help text): the flags --help
shows are compared with the flags the parser has.
"""
import json
import subprocess
import sys

import pytest

from hicache_mp import cli
from hicache_mp.engine.config import settings

FLAGS = ("--quick", "--hicache-storage-backend", "--hicache-mp-workers",
         "--hicache-storage-prefetch-policy", "--prefetch-timeout-s", "--page-size",
         "--hicache-mem-layout", "--storage-dir", "--scheduler-yield-ms", "--num-requests",
         "--seed", "--host-pool-pages", "--json", "--plot", "--no-verify", "--device-load",
         "--layer-groups",
         "--fast-file-read-workers", "--fast-file-write-workers", "--merge",
         "--scheduler-idle-sleep0")
# Engine flags come from the settings registry (hicache_mp.engine.config): each must be in --help.
ENGINE_FLAGS = tuple(f.metadata["setting"].flag for f in settings()
                     if f.metadata["setting"].flag and f.metadata["setting"].flag not in FLAGS)


def test_help_lists_every_flag_with_defaults():
    out = subprocess.run([sys.executable, "-m", "hicache_mp.cli", "bench", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--hicache-mp-direct-io" in ENGINE_FLAGS and "--storage-max-bytes" in ENGINE_FLAGS
    for flag in FLAGS + ENGINE_FLAGS:
        assert flag in out, flag
    text = " ".join(out.split())
    for shown in ("(default: wait_complete)", "(default: 64)", "(default: page_first)",
                  "(default: all)", "(default: 32)", "(default: 0)"):
        assert shown in text, shown
    parser_flags = {a for act in cli._bench_parser(
        __import__("argparse").ArgumentParser().add_subparsers())._actions
        for a in act.option_strings if a.startswith("--") and a != "--help"}
    assert parser_flags == set(FLAGS + ENGINE_FLAGS)


def test_small_run_prints_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    rc = cli.main(["bench", "--quick", "--num-requests", "3", "--hicache-storage-backend", "mp",
                   "--storage-dir", str(tmp_path / "s"), "--json", str(path)])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "Serving Benchmark Result (mp)" in out and "Comparison" in out
    rep = json.loads(path.read_text())
    # Progress (stderr) says how much has moved; its last line agrees with the report.
    gb = rep["runs"]["mp"]["engine"]["read_bytes"] / 1e9
    assert "[mp] 3/3 requests done at " in err and f"; {gb:.2f} GB prefetched so far" in err
    assert list(rep["runs"]) == ["mp"] and rep["command"][:2] == ["hicache-mp", "bench"]
    assert rep["runs"]["mp"]["summary"]["total_requests"] == 3


def test_yield_only_for_file(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--hicache-storage-backend", "mp", "--scheduler-yield-ms", "1"])


def test_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    rc = cli.main(["bench", "--quick", "--plot", str(tmp_path / "p.png")])
    assert rc == 2
    assert "pip install -e .[plot]" in capsys.readouterr().err


def test_fast_file_read_worker_counts_become_runs():
    parse = cli.build_parser().parse_args
    cfg = cli.bench_config(parse(["bench", "--fast-file-read-workers", "1,4"]))
    assert cfg.runs == ("none", "file", "file+yield", "fast_file", "fast_file-r4", "mp")
    cfg = cli.bench_config(parse(["bench", "--hicache-storage-backend", "fast_file",
                                  "--fast-file-read-workers", "4", "--fast-file-write-workers", "2"]))
    assert cfg.runs == ("fast_file-r4",) and cfg.fast_file_write_workers == 2
    for bad in ("0", "1,1", "x"):
        with pytest.raises(SystemExit):
            parse(["bench", "--fast-file-read-workers", bad])
    with pytest.raises(SystemExit):
        cli.bench_config(parse(["bench", "--fast-file-write-workers", "0"]))


def test_merge_prints_one_table_from_reports_run_apart(tmp_path, capsys):
    store = str(tmp_path / "s")
    paths = []
    for backend in ("mp", "fast_file"):
        paths.append(str(tmp_path / f"{backend}.json"))
        assert cli.main(["bench", "--quick", "--num-requests", "2", "--hicache-storage-backend",
                         backend, "--storage-dir", store, "--json", paths[-1]]) == 0
    capsys.readouterr()
    merged = tmp_path / "all.json"
    assert cli.main(["bench", "--merge", *paths, "--json", str(merged)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("Comparison"):]
    assert [line.split()[0] for line in table.splitlines()[3:5]] == ["mp", "fast_file"]
    # faster, level or slower: on a loaded box the two runs may come out level
    verdict = [line for line in out.splitlines() if line.startswith("Verdict")]
    assert verdict and verdict[0].startswith("Verdict (mean TTFT, this run): mp is ") \
        and "fast_file" in verdict[0], out
    rep = json.loads(merged.read_text())
    assert list(rep["runs"]) == ["mp", "fast_file"] and len(rep["merged_from"]) == 2
    # Another workload does not go in the same table.
    other = json.loads(open(paths[1]).read())
    other["config"]["num_requests"] = 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert cli.main(["bench", "--merge", paths[0], str(tmp_path / "other.json")]) == 2
    assert "reports differ in num_requests" in capsys.readouterr().err


def test_idle_sleep0_runs_are_labelled_and_yield_in_idle_steps(tmp_path, monkeypatch):
    import time as time_mod

    from hicache_mp.bench.sim import scheduler
    cfg = cli.bench_config(cli.build_parser().parse_args(
        ["bench", "--scheduler-idle-sleep0", "--fast-file-read-workers", "1,2"]))
    assert cfg.runs == ("none", "file+sleep0", "file+yield+sleep0", "fast_file+sleep0",
                        "fast_file-r2+sleep0", "mp+sleep0")
    calls = []
    real_sleep = time_mod.sleep
    monkeypatch.setattr(scheduler.time, "sleep", lambda s: (calls.append(s), real_sleep(s)))
    path = tmp_path / "r.json"
    base = ["bench", "--quick", "--num-requests", "2", "--hicache-storage-backend", "file",
            "--storage-dir", str(tmp_path / "s"), "--json", str(path)]
    assert cli.main(base) == 0
    assert 0 not in calls                # the stock loop never yields
    assert cli.main(base + ["--scheduler-idle-sleep0"]) == 0
    rep = json.loads(path.read_text())
    assert list(rep["runs"]) == ["file+sleep0"] and rep["runs"]["file+sleep0"]["backend"] == "file"
    assert calls.count(0) > 0            # sleep(0) in steps with nothing to run
