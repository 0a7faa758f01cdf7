"""Every module of hicache_mp/, workers/ and shm/ stays small: at most
MAX_MODULE_LINES lines a module and MAX_CLASS_LINES lines a class (the last
line's number less the first's), unless its docstring has a line that starts
with "Size:" and says why that one is bigger."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("hicache_mp", "workers", "shm")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300


def _sources():
    """(path relative to ROOT, source) of every module of PACKAGES."""
    for pkg in PACKAGES:
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path, encoding="utf-8") as fh:
                        yield os.path.relpath(path, ROOT), fh.read()


def _has_reason(node) -> bool:
    """The docstring has a line "Size: <why>" (text after the colon)."""
    doc = ast.get_docstring(node) or ""
    return any(line.strip().startswith("Size:") and line.strip()[len("Size:"):].strip()
               for line in doc.splitlines())


def oversized(sources) -> list[str]:
    """What is over its limit and does not say why, as 'path: what (lines)'."""
    out = []
    for rel, src in sources:
        tree = ast.parse(src, rel)
        lines = len(src.splitlines())
        if lines > MAX_MODULE_LINES and not _has_reason(tree):
            out.append(f"{rel}: module ({lines} lines)")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno
                if size > MAX_CLASS_LINES and not _has_reason(node):
                    out.append(f"{rel}: class {node.name} ({size} lines)")
    return out


def test_no_module_or_class_is_over_its_size_without_a_stated_reason():
    found = oversized(_sources())
    assert found == [], (f"over {MAX_MODULE_LINES} lines a module or {MAX_CLASS_LINES} a class: "
                         "split it along its seams, or give a 'Size: <why>' line in its "
                         f"docstring: {found}")


def test_the_check_sees_a_big_module_and_class_and_their_reasons():
    """The check is only as good as its scan: a long module and a long class
    are seen, and a "Size:" line with a reason (not an empty one) excuses each."""
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    big_class = f"class Big:\n    \"\"\"A class.\"\"\"\n{body}"
    small = "class Small:\n    pass\n"
    filler = "\n" * MAX_MODULE_LINES
    assert oversized([("a.py", small)]) == []
    assert oversized([("a.py", big_class)]) == [f"a.py: class Big ({MAX_CLASS_LINES + 1} lines)"]
    assert oversized([("a.py", big_class.replace("A class.", "A class.\n\n    Size: why."))]) == []
    assert oversized([("a.py", big_class.replace("A class.", "A class.\n\n    Size:"))]) != []
    long_module = f'"""A module."""\n{small}{filler}'
    assert oversized([("a.py", long_module)]) == [f"a.py: module ({MAX_MODULE_LINES + 3} lines)"]
    assert oversized([("a.py", long_module.replace("A module.", "A module.\n\nSize: why."))]) == []
