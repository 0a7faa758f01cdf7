"""Fixtures shared by every test: nothing may be left behind.

Every test, and every test module as a whole (its module-scoped fixtures
included), is checked for leftover `hicache_mp.*` entries in /dev/shm and for
live `hicache_mp-worker` (and `hicache_mp-evictor`) processes, after a short grace period for exits.
Entries and workers that belong to another live process tree (another test
session on the same machine) are not ours and are ignored; anything whose
owner is this process, one of its descendants, or dead, is ours.

One session hook: the fresh-interpreter import check (test_imports.py), the
SGLang plugin's fresh interpreters, the two-process SGLang harnesses, the
storage bench's runs and the small-/dev/shm SGLang scenario (tests/early.py)
start with the session, at the lowest CPU priority, beside
the collection and the tests before theirs. A harness's marked processes
are its own test's to check, not the guard's while they run.
"""
import compileall
import importlib.util
import json
import os
import sys
import tempfile
import time

import psutil
import pytest


from hicache_mp.bench.cgroups import ours_left as cgroups_left  # noqa: E402
from shm.names import list_ours, owner_pid  # noqa: E402

import early  # noqa: E402  (tests/early.py: the harnesses started with the session)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compile_project() -> None:
    """Where the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE,
    as on the CI box), every interpreter the suite starts (about a thousand
    workers, the servers and scripts of the fault tests, the fresh-import
    check's children) compiled this project's modules from source: ~40 ms of a
    worker's start. The project's own bytecode is written once here, as Python
    would write it by default (__pycache__/, ignored by git); those interpreters
    read it and still write none. Nothing outside the worktree is touched."""
    if not sys.flags.dont_write_bytecode:
        return  # Python writes it on first import anyway
    for d in ("shm", "workers", "hicache_mp", "tests", "scripts"):
        compileall.compile_dir(os.path.join(ROOT, d), quiet=2)


_compile_project()


def _ours(pid) -> bool:
    """Owned by this test process (or a descendant), or by nobody alive."""
    if pid is None or pid == os.getpid() or not psutil.pid_exists(pid):
        return True
    try:
        return any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
    except psutil.Error:
        return True


def _owners():
    """_ours, asked once per pid within one look (another session's segments
    share a few owners, and each ask walks that owner's parents)."""
    seen: dict = {}
    return lambda pid: seen[pid] if pid in seen else seen.setdefault(pid, _ours(pid))


_CHILDREN = (b"hicache_mp-worker", b"hicache_mp-evictor", b"hicache_mp-scanner")


def worker_pids() -> set[int]:
    """Live workers, evictors and store scanners of ours, from /proc/<pid>/cmdline directly
    (psutil's process_iter costs ~10x as much, and this runs around every test)."""
    pids, ours = set(), _owners()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")  # a zombie's is empty: not alive
        except OSError:
            continue
        if len(cmd) > 3 and cmd[3].startswith(_CHILDREN):
            try:
                parent = json.loads(cmd[4]).get("parent_pid") if len(cmd) > 4 else None
            except (TypeError, ValueError, AttributeError):
                continue  # no spec of ours: not one of our children
            if ours(parent) and not early.is_marked(int(entry)):
                pids.add(int(entry))  # a harness's own are its test's to check
    return pids


def shm_entries() -> set[str]:
    ours = _owners()

    def counted(pid) -> bool:  # a harness's own are its test's to check (tests/early.py)
        return ours(pid) and not (pid and early.is_marked(pid))
    return {n for n in list_ours() if counted(owner_pid(n))}


def _settle(check, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while True:
        left = check()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _guard(what: str):
    """Snapshot, run the body (the generator's caller), then fail on what is new."""
    early.note_marked()  # the harnesses' processes, remembered past their exit
    shm_before = shm_entries()
    procs_before = worker_pids()
    cgroups_before = cgroups_left()
    yield
    early.note_marked()
    shm_left = _settle(lambda: shm_entries() - shm_before)
    procs_left = _settle(lambda: worker_pids() - procs_before)
    cgroups = _settle(lambda: cgroups_left() - cgroups_before)
    assert not shm_left, f"{what} left shared memory behind: {sorted(shm_left)}"
    assert not procs_left, f"{what} left worker processes behind: {sorted(procs_left)}"
    assert not cgroups, f"{what} left cgroups behind: {sorted(cgroups)}"


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield from _guard("test")


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind_by_the_module():
    """The same check around each module: set up before, and torn down after,
    any module-scoped fixture (an engine its tests share), so what such a
    fixture made must be gone once the module is done."""
    yield from _guard("module")


_IMPORT_CHECK = os.path.join(ROOT, "tests", "test_imports.py")
_PLUGIN_TESTS = os.path.join(ROOT, "tests", "integrations", "test_sglang_plugin.py")
_FASTPATH_TESTS = os.path.join(ROOT, "tests", "integrations", "test_sglang_fastpath.py")
_STACK_TESTS = os.path.join(ROOT, "tests", "integrations", "test_sglang_stack.py")
_BENCH_STORAGE_TESTS = os.path.join(ROOT, "tests", "storage", "test_bench_storage.py")
_SHM_TESTS = os.path.join(ROOT, "tests", "test_containers_shm.py")


def _collects(config, path: str) -> bool:
    """Do this session's arguments name `path`, or a folder above it?"""
    bases = {str(config.invocation_params.dir), str(config.rootpath)}
    for arg in config.args:
        for base in bases:
            target = os.path.abspath(os.path.join(base, arg.split("::")[0]))
            if path == target or path.startswith(target.rstrip(os.sep) + os.sep):
                return True
    return False


def pytest_sessionstart(session):
    """What runs in processes of its own starts at once, in the background and
    at the lowest CPU priority (early.background), on what the collection (one
    core) and the tests leave idle: the fresh-interpreter import check
    (test_imports.py), the SGLang plugin's fresh interpreters
    (integrations/plugin_children.py), the two-process SGLang harnesses, the
    storage bench's runs and the small-/dev/shm SGLang scenario
    (tests/early.py). Each is mostly SGLang's import or CPU work of its own;
    their tests read them."""
    if _collects(session.config, _IMPORT_CHECK):
        import test_imports
        test_imports.start_early()
    if _collects(session.config, _PLUGIN_TESTS):
        _plugin_children().start_early()
    if _collects(session.config, _FASTPATH_TESTS):
        _plugin_children().start_route_early()
        early.start("fastpath_ranks")
    if _collects(session.config, _STACK_TESTS):
        early.start("sglang_ranks")
    if _collects(session.config, _BENCH_STORAGE_TESTS):
        early.start("bench_storage")
    if _collects(session.config, _SHM_TESTS):
        early.start("sglang_small_shm")


def _plugin_children():
    """integrations/plugin_children.py under the name its test imports it by
    (pytest puts that folder on sys.path when it collects the test)."""
    name = "plugin_children"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(ROOT, "tests", "integrations", name + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def pytest_unconfigure(config):
    for name in ("test_imports", "plugin_children"):
        check = sys.modules.get(name)
        if check is not None:
            check.stop_early()  # deselected, or the session was cut short
    early.stop_all()


@pytest.fixture
def store(tmp_path):
    d = tmp_path / "store"
    d.mkdir()
    return str(d)


