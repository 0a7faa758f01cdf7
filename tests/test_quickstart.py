"""examples/quickstart.py runs as it stands, the way a new user runs it."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_runs_and_checks_its_bytes():
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "16 pages of 256 KiB written and read back byte for byte by 2 workers" in out.stdout
    assert "Traceback" not in out.stderr and "leaked" not in out.stderr
