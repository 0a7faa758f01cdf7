"""Every module of shm/, workers/ and hicache_mp/ imports on its own in a fresh
interpreter, the project's top-level imports form no cycle, and no import
inside a function is there to hold a cycle apart."""
import ast
import json
import os
import subprocess
import sys
import tempfile

import hicache_mp

import early  # tests/early.py: the check runs at nice 19, on what the tests leave idle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("shm", "workers", "hicache_mp")

# Modules that need an optional dependency: without it, their import must
# fail with the ImportError that says what to install (and nothing else).
OPTIONAL = {"hicache_mp.integrations.sglang.backend": "needs SGLang",
            # the package imports the tier, hence vLLM (the module_path vLLM loads)
            "hicache_mp.integrations.vllm": "needs vLLM",
            "hicache_mp.integrations.vllm.api": "needs vLLM",
            "hicache_mp.integrations.vllm.tier": "needs vLLM",
            "hicache_mp.integrations.vllm.lookup": "needs vLLM",
            "hicache_mp.bench.sglang.nobytes": "needs SGLang",
            # SGLang's tree modules import its model configs, which import torchvision
            "hicache_mp.integrations.sglang.linker": "needs SGLang 0.5.23 with what its unified"}

# Every import of a project module inside a function, and why it is there.
# None of them may be there only to break a cycle.
LAZY = {
    ("hicache_mp/__init__.py", "hicache_mp.bench.baseline"):
        "the benchmark baselines import torch; `import hicache_mp` does not, and loads no bench code",
    ("hicache_mp/__init__.py", "hicache_mp.bench.fast_file"):
        "the benchmark baselines import torch; `import hicache_mp` does not, and loads no bench code",
    ("hicache_mp/integrations/sglang/__init__.py", "hicache_mp.integrations.sglang.backend"):
        "the backend imports SGLang; the package's SGLang-free modules (store_import for the "
        "CLI, settings for the flags reference) load without it",
    ("hicache_mp/bench/sim/bench.py", "hicache_mp.device"):
        "DeviceLoader imports torch: loaded only for a run with a device load",
    ("hicache_mp/bench/sim/bench.py", "hicache_mp.bench.sim.direct"):
        "the mp-direct run's loads import torch: loaded only for that run, so `hicache-mp "
        "--help` and the other runs start without torch (0.3 s, not 2)",
    ("hicache_mp/bench/sim/bench.py", "hicache_mp.device.layered"):
        "the layer-group rule's module imports torch: loaded only when mp-direct is asked for",
    ("hicache_mp/bench/vllm/tier.py", "hicache_mp.integrations.vllm"):
        "the tier imports vLLM's fs tier, which must come after the bench has made "
        "vllm.fs_io_C importable (load_fs_helper)",
    ("hicache_mp/bench/vllm/capacity.py", "hicache_mp.integrations.vllm"):
        "imports vLLM: the bench's --help and argument checks run without it",
}


def _modules() -> dict:
    """{dotted module name: path relative to ROOT} for every module of PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                    name = rel[:-3].replace(os.sep, ".")
                    out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = rel
    return out


MODULES = _modules()


def _targets(node, module: str, rel: str) -> list[str]:
    """The modules an import statement names (resolved; project modules kept
    as the most specific module that exists), dotted."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return subs + ([base] if len(subs) < len(node.names) else [])


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _imports(module: str, rel: str):
    """(top-level project imports, [(function-level project import)], third-party
    modules named at the top level) of one module."""
    with open(os.path.join(ROOT, rel)) as f:
        tree = ast.parse(f.read(), rel)
    top, lazy, third = set(), [], set()

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(child, module, rel):
                    if not _ours(target):
                        if not in_function and target.split(".")[0] not in sys.stdlib_module_names:
                            third.add(target)
                    elif in_function:
                        lazy.append(target)
                    else:
                        top.add(target)
            else:
                visit(child, in_function)

    visit(tree, False)
    return top, lazy, third


SCANS = {m: _imports(m, rel) for m, rel in MODULES.items()}

# Each module is imported in a child forked from one fresh interpreter that
# has loaded the third-party libraries only (numpy, torch, SGLang...): no
# project module is in it, so each child imports its module, and whatever
# that pulls in of the project, from nothing, at the cost of the project's
# own code rather than of torch's import, once per module.
RUNNER = r"""
import importlib, json, os, sys, traceback
modules, preload = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name in preload:
    try:
        importlib.import_module(name)
    except Exception:
        pass
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("shm", "workers", "hicache_mp"))
if leaked:
    sys.exit(f"a third-party preload imported project modules: {leaked}")
out, running, queue = {}, {}, list(modules)
while queue or running:
    while queue and len(running) < 4:  # a few at a time: each one is short
        name = queue.pop(0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                importlib.import_module(name)
                msg = ""
            except BaseException:
                msg = traceback.format_exc(limit=-8) or "failed"
            os.write(w, msg.encode()[-16384:])  # within a pipe's buffer: never blocks
            os._exit(0)
        os.close(w)
        running[pid] = name, r
    pid, code = os.wait()
    name, r = running.pop(pid)
    with os.fdopen(r, "rb") as f:
        out[name] = f.read().decode(errors="replace")
    if code and not out[name]:
        out[name] = f"exit status {code}"
print("\n" + json.dumps(out), flush=True)
os._exit(0)  # no teardown of torch, SGLang and vLLM (seconds): the answer is out
"""


class _Run:
    """The RUNNER's process, its output in temporary files (no pipe to fill)."""

    def __init__(self):
        preload = sorted({t for _, _, third in SCANS.values() for t in third})
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = early.background(subprocess.Popen(
            [sys.executable, "-c", RUNNER, json.dumps(sorted(MODULES)), json.dumps(preload)],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.out, stderr=self.err, text=True))

    def result(self, timeout_s: float) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout_s)
        finally:
            self.stop()
        self.out.seek(0), self.err.seek(0)
        return self.proc.returncode, self.out.read(), self.err.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_early: list = []


def start_early() -> None:
    """Start the fresh-interpreter check now, in the background (tests/conftest.py
    does at session start): its preload of torch, SGLang and vLLM, ~8 s of one
    core, then runs beside the collection, which imports them on the other."""
    if not _early:
        _early.append(_Run())


def stop_early() -> None:
    while _early:
        _early.pop().stop()


def test_every_module_imports_alone_in_a_fresh_interpreter():
    run = _early.pop() if _early else _Run()
    code, out, err = run.result(300)
    assert code == 0, err
    errors = json.loads(out.splitlines()[-1])
    assert sorted(errors) == sorted(MODULES)
    failed = {}
    for name, err in errors.items():
        if not err:
            continue
        if name in OPTIONAL and err.rstrip().splitlines()[-1].startswith("ImportError") \
                and OPTIONAL[name] in err:
            continue  # the optional dependency is missing, and the error says so
        failed[name] = err
    assert not failed, "\n\n".join(f"{n}:\n{e}" for n, e in failed.items())


def _cycle(graph: dict) -> list | None:
    """One cycle of `graph` ({module: [modules it imports]}) as a path, or None."""
    done, path = set(), []

    def walk(m):
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        for t in graph.get(m, ()):
            cycle = walk(t)
            if cycle:
                return cycle
        path.pop()
        done.add(m)
        return None

    for m in sorted(graph):
        cycle = walk(m)
        if cycle:
            return cycle
    return None


def test_the_project_imports_form_no_cycle():
    graph = {m: sorted(t for t in SCANS[m][0] if t in MODULES and t != m) for m in MODULES}
    assert sum(map(len, graph.values())) > len(MODULES)  # the scan found the imports
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_every_import_inside_a_function_has_a_stated_reason():
    found = {(MODULES[m], t) for m, (_, lazy, _) in SCANS.items() for t in lazy}
    unexplained = sorted(found - set(LAZY))
    assert not unexplained, ("imports of project modules inside functions: move each to the "
                             "top of its module, or say in LAZY why it cannot be: "
                             f"{unexplained}")
    assert sorted(set(LAZY) - found) == [], "LAZY lists imports that are gone"


def test_the_scan_sees_a_cycle_held_apart_inside_a_function(tmp_path, monkeypatch):
    """The checks above are only as good as the scan: a cycle that an import
    inside a function holds apart is seen, and so is the same cycle at the top."""
    (tmp_path / "workers").mkdir()
    (tmp_path / "workers" / "a.py").write_text("from workers import b\n")
    (tmp_path / "workers" / "b.py").write_text("import os\n\n\ndef f():\n    from . import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "MODULES",
                        {"workers.a": "workers/a.py", "workers.b": "workers/b.py"})
    a, b = _imports("workers.a", "workers/a.py"), _imports("workers.b", "workers/b.py")
    assert a[0] == {"workers.b"} and b[0] == set() and b[1] == ["workers.a"]
    assert _cycle({"workers.a": ["workers.b"], "workers.b": []}) is None
    assert _cycle({"workers.a": ["workers.b"], "workers.b": b[1]}) == \
        ["workers.a", "workers.b", "workers.a"]


def test_the_errors_a_user_catches_are_exported():
    from hicache_mp import BrokenPool, EngineClosed, EngineForked
    for cls in (BrokenPool, EngineClosed, EngineForked):
        assert issubclass(cls, RuntimeError)
        assert getattr(sys.modules[cls.__module__], cls.__name__) is cls  # the engine's own
    assert issubclass(EngineForked, EngineClosed)
    assert {"BrokenPool", "EngineClosed", "EngineForked"} <= set(hicache_mp.__all__)
