"""`hicache-mp` as a user meets it: `python3 -m hicache_mp`, its --help,
and bad paths, each refused in one line with exit status 2."""
import os
import subprocess
import sys

import pytest

from hicache_mp import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli_run(*argv, env=None, cwd=None):
    """`python3 -m hicache_mp ARGV` as a user runs it (this checkout's package)."""
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "hicache_mp", *argv], capture_output=True,
                          text=True, env=env, cwd=cwd or ROOT, timeout=300)


def test_python_m_hicache_mp_is_the_cli(tmp_path):
    """`python3 -m hicache_mp` works where the console script is not on PATH."""
    top = cli_run("--help", cwd=str(tmp_path))
    assert top.returncode == 0, top.stderr
    assert top.stdout.startswith("usage: hicache-mp ")
    assert "bench" in top.stdout and "import-sglang" in top.stdout
    assert cli_run("bench", "--help", cwd=str(tmp_path)).returncode == 0
    none = cli_run(cwd=str(tmp_path))   # no command: argparse's usage error
    assert none.returncode == 2 and "required: command" in none.stderr


def test_the_cli_loads_no_torch_until_a_run_moves_device_bytes():
    """`hicache-mp --help` and a bench's argument checks start in a fraction of a
    second: torch (~1.7 s to import) comes with the runs that need it."""
    out = subprocess.run([sys.executable, "-c", "import sys, hicache_mp.cli; "
                          "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['numpy']"]


@pytest.mark.parametrize("content, why", [
    (None, "No such file or directory"), ("dir", "Is a directory"),
    ("not json", "not JSON"), ("[1, 2]", "not a hicache_mp.bench/1 report"),
    ('{"schema": "hicache_mp.bench/1"}', "a hicache_mp.bench/1 report without config")])
def test_merge_of_what_is_no_report_is_one_line_naming_it(tmp_path, capsys, content, why):
    path = tmp_path / "r.json"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    assert cli.main(["bench", "--merge", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hicache-mp bench: --merge {path}: {why}")
    assert "hicache-mp bench --json PATH" in err


def test_a_bad_path_is_refused_before_anything_runs(tmp_path, capsys):
    """Each path option: one line naming it, exit status 2, nothing run (an
    output that cannot be written would have lost minutes of runs)."""
    a_file = tmp_path / "f"
    a_file.write_text("")
    missing = tmp_path / "nope" / "out.json"
    geometry = ["--layout", "page_first", "--model", "m", "--num-layers", "1",
                "--num-kv-heads", "1", "--head-dim", "8", "--page-size", "4"]
    for argv, said in (
            (["bench", "--json", str(missing)], f"--json {missing}: directory"),
            (["bench", "--json", str(tmp_path)], "it is a directory"),
            (["bench", "--storage-dir", str(a_file)], "it is a file, not a directory"),
            (["bench", "--storage-dir", str(a_file / "s")], "cannot make it"),
            (["import-sglang", "--src", str(a_file), "--dst", str(tmp_path / "d"), *geometry],
             f"--src {a_file} is not a directory"),
            (["import-sglang", "--src", str(tmp_path), "--dst", str(a_file), *geometry],
             f"--dst {a_file}: it is a file")):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (argv, err)
    assert sorted(os.listdir(tmp_path)) == ["f"]   # no store, report or import made
    out = cli_run("bench", "--merge", str(missing))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"hicache-mp bench: --merge {missing}: No such file or " \
        f"directory; expected a report written by `hicache-mp bench --json PATH`"


def test_help_shows_the_worker_setting_for_each_machine():
    """--help of hicache-mp, bench and import-sglang: an example each for a
    laptop, a bare-metal node and a small pod, line breaks kept."""
    top, bench, imp = (cli_run(*argv).stdout for argv in
                       (["--help"], ["bench", "--help"], ["import-sglang", "--help"]))
    for text in (top, bench, imp):
        assert "laptop" in text and "bare-metal node" in text and "CPU limit 4" in text
        assert "HICACHE_MP_NODE_CORES=16 hicache-mp " in text
    for text in (top, bench):
        assert "\n    hicache-mp bench --quick\n" in text
        assert "\n    hicache-mp bench --quick --hicache-mp-workers 2\n" in text
    assert '"num_workers" in --hicache-storage-backend-extra-config' in top
    assert "\n    hicache-mp import-sglang ... --workers 0\n" in imp
