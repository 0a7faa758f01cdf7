"""scripts/ and tests/ stay apart: what both need lives in the package
(hicache_mp.bench: the busy loop, the GIL tracer, the SGLang and vLLM rigs).

No test imports a module of scripts/, no script imports a module of tests/
or edits sys.path (scripts run as `python3 scripts/x.py` after
`pip install -e .`), and every script a user runs takes --help (argparse).
Static checks over the source: they cost no import of torch."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _py_files(top: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(os.path.join(ROOT, top)):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def _module_names(top: str) -> set[str]:
    return {os.path.basename(p)[:-3] for p in _py_files(top)}


def _imported(tree) -> set[str]:
    """Top-level names of every module an import statement names (absolute imports)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _touches_sys_path(tree) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "path"
               and isinstance(n.value, ast.Name) and n.value.id == "sys" for n in ast.walk(tree))


def _parse(path: str):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def scripts_imported_by_tests() -> list[str]:
    scripts = _module_names("scripts") - _module_names("tests")  # a test helper of the same name is its own
    return [f"{os.path.relpath(p, ROOT)}: {sorted(_imported(_parse(p)) & scripts)}"
            for p in _py_files("tests") if _imported(_parse(p)) & scripts]


def scripts_reaching_out() -> list[str]:
    tests = _module_names("tests") - {"conftest"}
    found = []
    for p in _py_files("scripts"):
        tree = _parse(p)
        if _imported(tree) & (tests | {"tests"}):
            found.append(f"{os.path.relpath(p, ROOT)}: imports {sorted(_imported(tree) & (tests | {'tests'}))}")
        if _touches_sys_path(tree):
            found.append(f"{os.path.relpath(p, ROOT)}: sys.path")
    return found


def test_no_test_imports_a_script():
    assert scripts_imported_by_tests() == []


def test_no_script_imports_tests_or_edits_sys_path():
    assert scripts_reaching_out() == []


def test_every_python_script_takes_help():
    """Each script parses its flags with argparse, or hands its command line to
    the package that does (runpy of a harness module, or the CLI's main)."""
    bare = []
    for p in _py_files("scripts"):
        tree = _parse(p)
        cli = any(isinstance(n, ast.ImportFrom) and n.module == "hicache_mp.cli"
                  for n in ast.walk(tree))
        if not _imported(tree) & {"argparse", "runpy"} and not cli:
            bare.append(os.path.relpath(p, ROOT))
    assert bare == []


def test_the_checks_see_what_they_forbid():
    src = "import sys\nsys.path.insert(0, 'x')\nimport giltrace\nfrom faultkit import make\n"
    tree = ast.parse(src)
    assert _touches_sys_path(tree) and {"giltrace", "faultkit"} <= _imported(tree)
    assert not _touches_sys_path(ast.parse("import os\nos.path.join('a')\n"))
