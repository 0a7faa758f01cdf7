"""Harnesses that run in processes of their own, started when the session
starts (tests/conftest.py) at the lowest CPU priority (`background`), so
their SGLang imports run on what the collection and the tests before theirs
leave idle; their test then reads the result.

Owns: the processes each harness started (a session each, marked with
HICACHE_MP_EARLY=<name>:<session pid> in their environment, which their engines' workers
inherit), their output files and directory. Must not: judge a result (its
test does), or start anything a test did not ask for: `start(name)` only
runs what `HARNESSES` names, with the arguments its test would give it.

Nothing-left checks: while a harness runs, the per-test guard
(tests/conftest.py) leaves its marked processes, and the /dev/shm entries
they own, alone (they belong to no test that is running); once it is done,
its test asserts that no process with its mark (its name and this session's
pid) is alive and that no entry of one is left (`left_behind`). The SGLang
plugin's fresh interpreters (integrations/plugin_children.py) carry marks too.
"""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARK = "HICACHE_MP_EARLY"


def _fastpath_ranks(d: str) -> list:
    """test_sglang_fastpath's two TP ranks: each runs stock, then the fast path."""
    rank = os.path.join(HERE, "integrations", "fastpath_rank.py")
    return [[sys.executable, rank, str(r), "2", os.path.join(d, "pg"), os.path.join(d, "store"),
             os.path.join(d, f"r{r}.json"), "stock,fast", str(160 if r == 0 else 100)]
            for r in (0, 1)]


# test_sglang_stack's small geometry (its SMALL), here so its harness run has it too
STACK_SMALL = ["--round-mib", "2", "--page-mib", "0.125", "--layers", "2", "--heads", "4",
               "--head-dim", "64", "--timeout-s", "60"]


def _sglang_ranks(d: str) -> list:
    """test_sglang_stack's node split: scripts/sglang_ranks.py on a node of 8 cores."""
    return [[sys.executable, os.path.join(ROOT, "scripts", "sglang_ranks.py"), "--ranks", "2",
             *STACK_SMALL, "--runs", "1", "--json", os.path.join(d, "ranks.json")]]


# test_bench_storage's runs, at its SMALL scale: one directory each, which holds
# only the JSON once the bench has removed its scratch directory
BENCH_STORAGE_SMALL = ["--quick", "--total-gib", str(1 / 64)]


def _bench_storage(d: str) -> list:
    """test_bench_storage's two runs of scripts/bench_storage.py: the quick one
    (raw ceilings at 2 threads and processes, one mixed pair) and --mixed-only
    (two pairs). Pure CPU and page-cache work in processes of their own: at
    nice 19 they take ~10 s of the cores the session leaves idle."""
    script = os.path.join(ROOT, "scripts", "bench_storage.py")
    runs = {"quick": ["--raw-threads", "2", "--mixed-repeats", "1"],
            "mixed": ["--mixed-only", "--mixed-repeats", "2"]}
    out = []
    for name, extra in runs.items():
        os.makedirs(os.path.join(d, name))
        out.append([sys.executable, script, *BENCH_STORAGE_SMALL, *extra,
                    "--dir", os.path.join(d, name), "--json", os.path.join(d, name, "bs.json")])
    return out


def sglang_shm_cases(store: str) -> dict:
    """test_containers_shm's SGLang attach in a 64 MiB /dev/shm: the staging path
    with a pool too large, and zero-copy where another program left room for the
    control block (and the store scan's ring beside it), not for 4 workers'
    rings. Here, so its run at session start has them too."""
    from shm.ring import ring_bytes
    from workers.control import CONTROL_BYTES
    from workers.scanner import SCAN_RING_CAPACITY
    return {"store": store, "cases": [
        ["default", {"staging_pages": 50000}, None],
        ["shm", {"num_workers": 4}, CONTROL_BYTES + ring_bytes(SCAN_RING_CAPACITY) + 3 * 4096]]}


def _sglang_small_shm(d: str) -> list:
    """test_containers_shm's SGLang scenario (tests/containerkit.py): mostly
    SGLang's import, in a private mount namespace. Where unshare is refused
    it fails here, and its test skips first (containerkit.require_namespaces)."""
    import containerkit
    os.makedirs(os.path.join(d, "store"))
    return [containerkit.private_shm_argv("64m", "sglang_small_shm",
                                          sglang_shm_cases(os.path.join(d, "store")))]


def _containerkit_env(d: str) -> dict:
    import containerkit
    env = containerkit.child_env()
    return {k: env[k] for k in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}


# name -> (the commands for a directory, extra environment for a directory)
HARNESSES = {
    "sglang_small_shm": (_sglang_small_shm, _containerkit_env),
    "bench_storage": (_bench_storage, lambda d: {}),
    "fastpath_ranks": (_fastpath_ranks, lambda d: {
        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(HERE, "integrations"),
                                       os.environ.get("PYTHONPATH", "")])}),
    "sglang_ranks": (_sglang_ranks, lambda d: {
        "HICACHE_MP_NODE_CORES": "8", "HICACHE_MP_NODE_DIR": os.path.join(d, "node")}),
}

_started: dict = {}


class Run:
    """One harness's processes, started at once in a directory of their own."""

    def __init__(self, name: str, timeout: int = 240):
        commands, extra = HARNESSES[name]
        self.name, self.timeout = name, timeout
        self.dir = tempfile.mkdtemp(prefix=f"hicache_mp-early-{name}-")
        env = dict(os.environ, **extra(self.dir))
        env[MARK] = self.mark = f"{name}:{os.getpid()}"  # this session's, not another's
        env["TMPDIR"] = self.dir  # SGLang's and torch's files stay in the harness's dir
        self.procs, self.errs = [], []
        for i, argv in enumerate(commands(self.dir)):
            err = open(os.path.join(self.dir, f"stderr.{i}"), "w+")
            self.errs.append(err)
            with open(os.path.join(self.dir, f"stdout.{i}"), "w") as out:  # (path("stdout.<i>"))
                self.procs.append(background(subprocess.Popen(
                    argv, env=env, cwd=ROOT, stdout=out, stderr=err, start_new_session=True)))

    def wait(self) -> tuple[list, list]:
        """Exit codes and the last 3000 characters of each one's stderr."""
        deadline = time.monotonic() + self.timeout
        try:
            for p in self.procs:
                p.wait(max(0.1, deadline - time.monotonic()))
        finally:
            self.stop()
        tails = []
        for err in self.errs:
            err.seek(0)
            tails.append(err.read()[-3000:])
        return [p.returncode for p in self.procs], tails

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def left_behind(self, grace_s: float = 3.0) -> list:
        """Its processes still alive, and its /dev/shm entries, after `grace_s`."""
        return left_behind(self.mark, grace_s)

    def stop(self) -> None:
        """Kill what still runs (a harness whose test was deselected, or one
        past its timeout), its whole session at once. What its engines had in
        /dev/shm, and their node registry entries, are then a dead owner's:
        removed here as the next engine's start would remove them (the
        workers died with their scheduler, so no orphan cleans up after it).
        A harness that ended by itself is left as it was: its test checks
        what it left (`left_behind`)."""
        killed = []
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
                killed.append(p.pid)
        if killed:
            _after_a_kill(killed)

    def close(self) -> None:
        self.stop()
        for err in self.errs:
            err.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _after_a_kill(groups: list) -> None:
    """A killed harness's names and node registry entries, gone (see Run.stop),
    once every process of its killed `groups` has exited: a worker that still
    holds its owner's lock keeps the names its owner's (shm.names)."""
    from hicache_mp.engine.nodebudget import live_shares, node_dir, remove_if_empty
    from shm.names import clean_stale
    deadline = time.monotonic() + 5
    for group in groups:
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
    clean_stale()
    if os.path.isdir(node_dir()):
        live_shares(node_dir(), prune=True)
        remove_if_empty(node_dir())


def background(proc: subprocess.Popen) -> subprocess.Popen:
    """`proc` at the lowest CPU priority (nice 19, which the processes it starts
    inherit): it runs on what the collection and the tests leave idle, never
    slowing them. On the 2-core box the session leaves ~280 core-seconds idle;
    at the default priority these harnesses took them from the collection
    (14 s alone, 57 s beside them) and from the timing-bound fault tests.

    A process started in a session of its own (start_new_session) is also in
    a scheduler autogroup of its own where the kernel has them
    (/proc/sys/kernel/sched_autogroup_enabled): the kernel then shares the CPU
    between autogroups first, and a nice value counts only inside its own
    group. The group's nice is set too, or nice 19 changes nothing: the
    collection took 44 s beside these harnesses, 11 s without them."""
    try:
        os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
        if os.getsid(proc.pid) == proc.pid:
            with open(f"/proc/{proc.pid}/autogroup", "w") as f:
                f.write("19")
    except OSError:
        pass  # gone already, no autogroups, or not allowed: it runs at the default priority
    return proc


def _mark_of(pid) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    prefix = f"{MARK}=".encode()
    for v in env:
        if v.startswith(prefix):
            return v[len(prefix):].decode(errors="replace")
    return None


def marked_by() -> dict:
    """{pid: mark} of the live processes that carry a mark."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            mark = _mark_of(entry)
            if mark is not None:
                out[int(entry)] = mark
    return out


def left_behind(mark: str, grace_s: float = 3.0) -> list:
    """What a finished harness (or child) of `mark` left after `grace_s`: its
    processes still alive, and /dev/shm entries owned by a process seen with
    the mark."""
    from shm.names import list_ours, owner_pid
    deadline = time.monotonic() + grace_s
    while True:
        live = marked_by()
        _SEEN.update(live)
        alive = [pid for pid, m in live.items() if m == mark]
        mine = {pid for pid, m in _SEEN.items() if m == mark}
        shm = [n for n in list_ours() if owner_pid(n) in mine]
        if not (alive or shm) or time.monotonic() > deadline:
            return alive + shm
        time.sleep(0.05)


# Pids seen carrying a mark, and the mark: a harness's process that has
# exited (its environment unreadable, or a zombie's empty) still owns what its
# engines' workers are cleaning up after it, at nice 19, maybe seconds later.
_SEEN: dict = {}


def note_marked() -> None:
    """Remember every live marked process (the guard calls it around each test)."""
    _SEEN.update(marked_by())


def is_marked(pid: int) -> bool:
    """Does this process carry a harness's mark, or did it while alive (so it
    is no running test's)? A pid reused since by another process would be
    taken for the harness's: a leak of that one would go unseen by the guard."""
    if pid in _SEEN:
        return True
    mark = _mark_of(pid)
    if mark is not None:
        _SEEN[pid] = mark
    return mark is not None


def start(name: str) -> None:
    if name not in _started:
        _started[name] = Run(name)


def take(name: str) -> Run:
    """What the session started, or a fresh start; the caller closes it."""
    start(name)
    return _started.pop(name)


@contextlib.contextmanager
def finished(name: str):
    """What the session started as `name` (or a fresh start), once it has
    ended and been checked to have left no process or /dev/shm entry behind:
    yields (the run, its exit codes, its stderr tails); closed after."""
    run = take(name)
    try:
        rcs, errs = run.wait()
        assert not run.left_behind(), f"{name} left processes or shared memory behind"
        yield run, rcs, errs
    finally:
        run.close()


def stop_all() -> None:
    while _started:
        _started.popitem()[1].close()
