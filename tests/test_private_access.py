"""No module reads or writes another object's private fields (issue 34).

Parses every module of the product packages (hicache_mp/, workers/, shm/)
with `ast` and finds each attribute access `X._name` where X is not `self` or
`cls`. It is allowed inside a class that defines `_name` itself (a method, a
`self._name = ...`, a class attribute or a __slots__ entry: an object of that
class reading its own kind's field, as `other._lead` in a comparison would),
in the module-level code of the module whose classes define it (an at-fork
hook over its own objects), and for dunder names. Everything else is a finding, unless ALLOWED names it
with a one-line reason: other projects' private attributes that an adapter
must read, the standard library's underscore names that are public API, and
the cases still to remove ("to do"), so the list is honest and shrinks.

The tests may reach inside (a fault test plays a dying worker or a torn
control word, which no public call may offer), but each test module says so:
its docstring has a paragraph beginning `Reaches inside:` that names every
private name the module reads or writes, and why. The same `private_accesses`
scan over tests/ finds any name missing there, and any name listed there that
the module no longer uses.

Runs in well under a second: no module is imported.
"""
import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("hicache_mp", "workers", "shm")
TESTS = ROOT / "tests"
REACHES = "Reaches inside:"

# Underscore names that are public API of the standard library or numpy,
# wherever they are read.
PUBLIC_UNDERSCORE = {
    "_exit": "os._exit: the documented way out of a forked child without teardown",
    "_replace": "namedtuple / dataclass-like _replace: public API",
    "_asdict": "namedtuple._asdict: public API",
    "_fields": "namedtuple._fields: public API",
}

# (module path, attribute) -> why it stays. Only other projects' private
# names are here: the standard library's and those of the engines the benches
# drive. No module of this project reaches into another's (issue 34); a new
# need gets a public call on the owner, not an entry here.
ALLOWED = {
    # threading.RLock has no public "held by this thread?" query.
    ("hicache_mp/engine/closing.py", "_is_owned"): "RLock._is_owned: no public query; a "
                                                   "handler that interrupted this thread's update",
    # Other projects' private attributes the benches must read or set.
    ("hicache_mp/bench/vllm/tier.py", "_use_o_direct"): "vLLM's tier: O_DIRECT forced off "
                                                        "for the bench's page-cache runs",
    ("hicache_mp/bench/vllm/tier.py", "_HAS_FSIO_C"): "vLLM: which C helpers it loaded",
    ("hicache_mp/bench/vllm/tier.py", "_HAS_BATCH_LOOKUP_C"): "vLLM: which C helpers it loaded",
    ("hicache_mp/bench/sglang/stack.py", "_stop_storage_threads"): "SGLang's cache controller: "
                                                                   "its only stop call",
}


def _defined_names(cls: ast.ClassDef) -> set:
    """What a class defines for itself: methods, class attributes, __slots__
    entries and every `self.X = ...` (or `self.X += ...`) in its methods."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                    if t.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                        names.update(e.value for e in node.value.elts
                                     if isinstance(e, ast.Constant) and isinstance(e.value, str))
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and \
                        sub.value.id in ("self", "cls"):
                    names.add(sub.attr)
    return names


def private_accesses(path: pathlib.Path) -> list:
    """(line, expression, attribute) of each access to another object's private field."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    # module-level code (an at-fork hook, a helper) may use what the module's
    # own classes define: it is one module's field, not another's
    module_own = frozenset().union(*[_defined_names(c) for c in ast.walk(tree)
                                     if isinstance(c, ast.ClassDef)])

    def visit(node, own: set):
        if isinstance(node, ast.ClassDef):
            own = own | _defined_names(node)
        if isinstance(node, ast.Attribute):
            name = node.attr
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and name not in own and name not in PUBLIC_UNDERSCORE:
                found.append((node.lineno, ast.unparse(node), name))
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            visit(node, frozenset())
        else:
            visit(node, module_own)
    return found


def reaches_listed(path: pathlib.Path) -> set:
    """The private names the module docstring's `Reaches inside:` paragraph
    names (every `_name` in it, as `_pool` or `e._pool.workers`); empty
    without one. The paragraph runs from its first line to the next blank line."""
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    names, inside = set(), False
    for line in doc.splitlines():
        if not line.strip():
            inside = False
        elif line.lstrip().startswith(REACHES):
            inside = True
        if inside:
            names.update(re.findall(r"(?<![A-Za-z0-9_])_[A-Za-z0-9_]+", line))
    return {n for n in names if not n.startswith("__")}


@functools.lru_cache(maxsize=None)
def reach_findings(root: pathlib.Path = TESTS) -> tuple:
    """(unlisted, stale) over every .py under `root`: `file:line: expr` of each
    access whose name its module's `Reaches inside:` paragraph does not name,
    and `file: name` of each name listed there that the module no longer reaches."""
    unlisted, stale = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        listed = reaches_listed(path)
        used = set()
        for line, expr, name in private_accesses(path):
            used.add(name)
            if name not in listed:
                unlisted.append(f"{rel}:{line}: {expr}")
        stale += [f"{rel}: {name}" for name in sorted(listed - used)]
    return unlisted, stale


def findings() -> list:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, expr, name in private_accesses(path):
                if (rel, name) not in ALLOWED:
                    out.append(f"{rel}:{line}: {expr}")
    return out


def test_no_module_reads_another_objects_private_fields():
    bad = findings()
    assert not bad, ("another object's private field (add a public call, or an ALLOWED "
                     "entry with its reason):\n  " + "\n  ".join(bad))


def test_every_allowed_entry_is_still_needed():
    """An entry whose access is gone leaves the list, so it only shrinks."""
    used = set()
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            used.update((rel, name) for _, _, name in private_accesses(path))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries no access needs any more: {stale}"


def test_the_check_finds_what_it_is_for(tmp_path):
    src = ("class A:\n"
           "    def __init__(self):\n"
           "        self._mine = 1\n"
           "    def same(self, other):\n"
           "        return other._mine\n"          # allowed: A defines _mine
           "def f(engine):\n"
           "    engine._ops[1] = 2\n"             # another object's private field
           "    return engine.__class__, engine._lock\n")
    path = tmp_path / "probe.py"
    path.write_text(src)
    assert [(line, name) for line, _, name in private_accesses(path)] == [(7, "_ops"), (8, "_lock")]


def test_tests_say_why_they_reach_inside():
    """A test may read or write another object's private field (fault
    injection, another project's private method it replaces), but its module
    says which and why, in its docstring's `Reaches inside:` paragraph."""
    unlisted, _ = reach_findings()
    assert not unlisted, (f"a private name its module's docstring does not name in a "
                          f"'{REACHES}' paragraph (use a public call, or name it there "
                          f"with the reason):\n  " + "\n  ".join(unlisted))


def test_every_listed_reach_is_still_used():
    """A name listed in a `Reaches inside:` paragraph that its module no longer
    reaches leaves the paragraph, so the lists only say what is true."""
    _, stale = reach_findings()
    assert not stale, f"listed in a '{REACHES}' paragraph, reached no more: {stale}"


def test_the_test_check_finds_an_unlisted_reach_and_accepts_a_listed_one(tmp_path):
    tests = tmp_path / "tests"
    (tests / "faults").mkdir(parents=True)
    body = ("def test_it(e):\n"
            "    e._pool.workers[0].kill()\n"     # line 2 of the body
            "    return e._control, os._exit\n")  # os._exit: public API, never listed
    unsaid = tests / "faults" / "test_unsaid.py"
    unsaid.write_text('"""Kills a worker.\n\nReaches inside: `_pool`, to kill it."""\n' + body)
    said = tests / "test_said.py"
    said.write_text('"""Kills a worker.\n\nReaches inside: `_pool` (the worker to kill)\n'
                    'and `e._control` (a torn control word): fault injection.\n"""\n' + body)
    silent = tests / "test_silent.py"
    silent.write_text(body)   # no docstring at all
    stale = tests / "test_stale.py"
    stale.write_text('"""Nothing.\n\nReaches inside: `_evictor`, once.\n\n'
                     'Later text: `_pool` is not listed here.\n"""\nx = 1\n')
    assert reaches_listed(said) == {"_pool", "_control"}
    assert reaches_listed(stale) == {"_evictor"}   # its paragraph ends at the blank line
    unlisted, stale_names = reach_findings(tests)
    assert unlisted == ["tests/faults/test_unsaid.py:6: e._control",
                        "tests/test_silent.py:2: e._pool", "tests/test_silent.py:3: e._control"]
    assert stale_names == ["tests/test_stale.py: _evictor"]
