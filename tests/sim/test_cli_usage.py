"""`hicache-mp` as a user meets it: `python3 -m hicache_mp`, its --help,
and bad paths, each refused in one line with exit status 2."""
import os
import subprocess
import sys

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
