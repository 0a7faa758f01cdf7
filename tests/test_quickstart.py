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


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_library_use_is_an_excerpt_of_the_quickstart():
    text = _readme()
    section = text[text.index("## Library use"):]
    block = section[section.index("```python") + len("```python"):]
    block = block[:block.index("```")]
    with open(os.path.join(ROOT, "examples", "quickstart.py")) as f:
        script = {line.strip() for line in f}
    missing = [line.strip() for line in block.splitlines()
               if line.strip() and line.strip() != "..." and line.strip() not in script]
    assert missing == []


def test_readme_links_the_design_in_the_project():
    text = _readme()
    assert "](docs/design.md)" in text and "../" + "shared" not in text
    assert os.path.isfile(os.path.join(ROOT, "docs", "design.md"))
