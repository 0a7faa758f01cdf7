"""The documentation stays true: the flags reference matches the declarations,
the README stays short, the decision records are headed and indexed, and no
file points outside the repository."""
import glob
import os
import re
import subprocess

import pytest

from hicache_mp import flagsdoc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 250
# Spelt in pieces so that this file does not match itself.
OUTSIDE = ("../" + "shared", "DESIGN" + ".md", "WORKLOAD" + ".md")
OLD_DECISIONS = "docs/decisions" + ".md"
STATUS = re.compile(r"(accepted|accepted \(amended by \d+(, \d+)*\)|superseded by \d+)")


def _read(*parts) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _tracked_text_files() -> list[str]:
    """The repository's files (git's list in a clone, else a walk), text only."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout.decode()
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = []
        for d, dirs, files in os.walk(ROOT):
            dirs[:] = [x for x in dirs if not x.startswith(".") and not x.endswith(".egg-info")
                       and x != "__pycache__"]
            paths += [os.path.relpath(os.path.join(d, f), ROOT) for f in files]
    texts = []
    for p in paths:
        full = os.path.join(ROOT, p)
        if not os.path.isfile(full):
            continue  # deleted in the working tree, not yet committed
        with open(full, "rb") as f:
            head = f.read(8192)
        if b"\0" not in head:
            texts.append(p)
    return texts


def test_the_flags_reference_is_generated_from_the_declarations():
    text = _read("docs", "flags.md")
    fix = "docs/flags.md is out of date: run python3 -m hicache_mp.flagsdoc"
    assert flagsdoc.HEADER in text and flagsdoc.engine_section() in text, fix
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    assert text == flagsdoc.render(), fix


def test_the_generator_writes_what_the_check_accepts(tmp_path):
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    out = str(tmp_path / "flags.md")
    assert flagsdoc.main(["--out", out, "--check"]) == 1      # nothing there yet
    assert flagsdoc.main(["--out", out]) == 0
    assert flagsdoc.main(["--out", out, "--check"]) == 0
    with open(out, "a") as f:
        f.write("a hand edit\n")
    assert flagsdoc.main(["--out", out, "--check"]) == 1


def test_the_readme_is_short():
    lines = _read("README.md").splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines; at most {README_MAX_LINES}: move detail into docs/"


def test_no_file_points_outside_the_repository():
    found = []
    for path in _tracked_text_files():
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                for word in OUTSIDE + (OLD_DECISIONS,):
                    if word in line:
                        found.append(f"{path}:{n}: {word}")
    assert found == []


def _records() -> dict[int, tuple[str, str, str]]:
    """{number: (file name, title, status)} of docs/decisions/NN-slug.md."""
    out = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "decisions", "*.md"))):
        name = os.path.basename(path)
        if name == "README.md":
            continue
        m = re.fullmatch(r"(\d{2,})-[a-z0-9]+(-[a-z0-9]+)*\.md", name)
        assert m, f"{name}: a record is named NN-short-slug.md"
        lines = _read("docs", "decisions", name).splitlines()
        head = re.fullmatch(r"# (\d+)\. (\S.*)", lines[0])
        assert head and int(head.group(1)) == int(m.group(1)), \
            f"{name}: the first line is '# {int(m.group(1))}. Title'"
        status = [ln[len("Status: "):] for ln in lines[1:4] if ln.startswith("Status: ")]
        assert status and STATUS.fullmatch(status[0]), \
            f"{name}: a 'Status: accepted' or 'Status: superseded by N' line under the title"
        number = int(m.group(1))
        assert number not in out, f"two records numbered {number}"
        out[number] = (name, head.group(2), status[0])
    return out


def test_every_decision_is_a_headed_record_in_the_index():
    records = _records()
    assert records and not os.path.exists(os.path.join(ROOT, OLD_DECISIONS))
    for number, (name, _, status) in records.items():
        for later in map(int, re.findall(r"\d+", status)):
            assert later in records and later > number, f"{name}: {status} names no later record"
    index = _read("docs", "decisions", "README.md")
    rows = {int(m.group(1)): (m.group(2), m.group(3).strip(), m.group(4).strip())
            for m in re.finditer(r"^\| \[(\d+)\]\(([^)]+)\) \|(.+)\|(.+)\|$", index, re.M)}
    want = {n: (name, title, status) for n, (name, title, status) in records.items()}
    missing = [f"| [{n}]({w[0]}) | {w[1]} | {w[2]} |" for n, w in sorted(want.items())
               if rows.get(n) != w]
    assert missing == [], "docs/decisions/README.md lacks or misstates these rows"
    assert set(rows) == set(records), "the index names records that do not exist"


def test_the_design_names_every_module_of_the_product():
    """docs/design.md's map of the parts stays true as modules come and go:
    each module of shm/, workers/ and hicache_mp/ is named there (by its file
    name, as the module tables and lists spell them)."""
    design = _read("docs", "design.md")
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*\.py", design))
    missing = []
    for pkg in ("shm", "workers", "hicache_mp"):
        for d, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            missing += [os.path.relpath(os.path.join(d, f), ROOT) for f in files
                        if f.endswith(".py") and f != "__init__.py" and f not in named]
    assert len(named) > 20  # the scan read the tables
    assert not missing, f"modules docs/design.md does not name: {sorted(missing)}"
