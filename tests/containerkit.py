"""Containers, reproduced: a private /dev/shm, a new PID namespace, another uid.

Each case runs a scenario (a function below) in a child process inside its
own mount namespace (`unshare -m`) with a small tmpfs mounted on /dev/shm, as
a pod's emptyDir or Docker's 64 MiB default is. The machine's /dev/shm is
never touched, and the tmpfs goes with the namespace. A scenario starts
engines in further children: as pid 1 of a new PID namespace (`unshare -p -f
--mount-proc`, as a container's entrypoint is), or as uid 1000 (`setpriv`)
with the interpreter that runs the suite, wherever it lies (`_user_python`:
in root's 0700 home too, a venv or not). Every child runs this file (`python containerkit.py ROLE JSON`) and prints
one `RESULT <json>` line. Torch-free but for the SGLang scenario.
"""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PATH = os.pathsep.join([ROOT, HERE, os.path.join(HERE, "faults"), os.path.join(HERE, "integrations")])
MID = dict(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16)  # 64 KiB pages
USER = 1000


def child_env() -> dict:
    """The environment every child of this kit runs with (its imports on the path)."""
    return {**os.environ, "PYTHONPATH": PATH, "PYTHONDONTWRITEBYTECODE": "1"}


def _result(proc_stdout: str, stderr: str, rc) -> dict:
    for line in proc_stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"child failed (rc {rc}):\n{stderr[-4000:]}")


# --- the test's side ------------------------------------------------------------
def require_namespaces() -> None:
    """Skip, with the reason, where a private /dev/shm cannot be made."""
    import pytest
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a private /dev/shm and PID namespace")
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /dev/shm && "
                            "unshare -p -f --mount-proc true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare is not permitted here: {probe.stderr.decode()[-200:]}")


def private_shm_argv(size: str, scenario: str, args: dict) -> list:
    """The command that runs `scenario` in a mount namespace whose /dev/shm is a
    fresh tmpfs of `size` (run with `child_env()`; its stdout holds the RESULT)."""
    cmd = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" "$1" "$2" "$3"'
    return ["unshare", "-m", "sh", "-c", cmd, sys.executable, __file__, scenario, json.dumps(args)]


def scenario_result(stdout: str, stderr: str, rc) -> dict:
    """A scenario's RESULT; a skip it asked for is the test's skip."""
    got = _result(stdout, stderr, rc)
    if "skip" in got:
        import pytest
        pytest.skip(got["skip"])
    return got


def in_private_shm(size: str, scenario: str, args: dict, timeout_s: float = 120) -> dict:
    """Run `scenario` in a mount namespace whose /dev/shm is a fresh tmpfs of `size`."""
    proc = subprocess.run(private_shm_argv(size, scenario, args), capture_output=True, text=True,
                          env=child_env(), timeout=timeout_s)
    return scenario_result(proc.stdout, proc.stderr, proc.returncode)


# --- inside the namespace -----------------------------------------------------
def _child(prefix: list, role: str, args: dict) -> subprocess.Popen:
    """`prefix` ends with an interpreter, or this one runs the child."""
    python = [] if prefix and "python" in os.path.basename(prefix[-1]) else [sys.executable]
    return subprocess.Popen([*prefix, *python, __file__, role, json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def _run(prefix: list, role: str, args: dict, timeout_s: float = 60) -> dict:
    p = _child(prefix, role, args)
    out, err = p.communicate(timeout=timeout_s)
    return _result(out, err, p.returncode)


def _ready(p: subprocess.Popen) -> dict:
    """The READY line of a child that stays up, or its failure."""
    line = p.stdout.readline()
    if not line.startswith("READY "):
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"child did not start (rc {p.returncode}): {line}{out}\n{err[-4000:]}")
    return json.loads(line[len("READY "):])


def left_in_shm() -> list:
    """What is left in /dev/shm, the node registry's entries included."""
    out = []
    for d, dirs, files in os.walk("/dev/shm"):
        out += [os.path.relpath(os.path.join(d, x), "/dev/shm") for x in files + dirs]
    return sorted(out)


def _kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL `p`'s children (an engine under `unshare -f`, or its workers), then p."""
    import psutil
    for c in psutil.Process(p.pid).children(recursive=True):
        try:
            c.kill()
        except psutil.Error:
            pass
    p.kill()
    p.wait()


def restarts(args: dict) -> dict:
    """A container restarted `times` times over the same /dev/shm: each engine is
    pid 1 of a new PID namespace and is SIGKILLed (its workers die with the
    namespace); a last one starts and closes."""
    ns = ["unshare", "-p", "-f", "--mount-proc"]
    runs = []
    for i in range(args["times"] + 1):
        last = i == args["times"]
        p = _child(ns, "engine", {**args, "workers": args["workers"][i % len(args["workers"])],
                                  "write": f"k{i}", "read": f"k{i - 1}" if i else None,
                                  "stay": not last})
        got = _ready(p)
        if not last:
            import psutil
            engine = psutil.Process(p.pid).children()[0]  # pid 1 inside, this pid outside
            os.kill(engine.pid, signal.SIGKILL)  # as the kubelet stops a container
            p.wait(30)
        else:
            p.communicate(timeout=60)
        runs.append(got)
    return {"runs": runs, "left": left_in_shm()}


def users(args: dict) -> dict:
    """uid USER's engines (explicit and auto workers) beside a running root
    engine with auto workers, then after it and its workers were SIGKILLed
    (its segments, lock and registry entry left behind, and an older
    engine's leftovers with no lock file); a last root engine then cleans."""
    as_user = ["setpriv", "--reuid", str(USER), "--regid", str(USER), "--clear-groups",
               _user_python()]
    out = {"beside": [], "after": []}
    root = _child([], "engine", {"store": args["root_store"], "pages": 8, "workers": 0,
                                 "write": "root", "stay": True})
    out["root"] = _ready(root)
    try:
        for workers in (2, 0):
            out["beside"].append(_run(as_user, "engine", {"store": args["user_store"], "pages": 8,
                                                          "workers": workers, "write": f"b{workers}"}))
    finally:
        _kill_tree(root)
    out["root_left"] = left_in_shm()
    _older_engines_leftovers()
    for workers in (2, 0):
        out["after"].append(_run(as_user, "engine", {"store": args["user_store"], "pages": 8,
                                                     "workers": workers, "write": f"a{workers}"}))
    out["user_left"] = left_in_shm()
    out["last"] = _run([], "engine", {"store": args["root_store"], "pages": 8, "workers": 0,
                                      "write": "last"})
    out["left"] = left_in_shm()
    return out


class CannotRun(Exception):
    """uid USER cannot run the interpreter here, even with the directories on
    its way opened up: the scenario ends at once and its test skips with this."""


def _user_python(python: str = sys.executable) -> str:
    """`python`, made runnable by uid USER with every package it has, in this
    mount namespace only; CannotRun (with the reason) where it stays out of reach.

    An interpreter often lies in a home only its owner may enter: pyenv's in
    /root (0700), a venv beside it or inside it, whose bin/python3 is a
    symlink into the base installation and whose site-packages lie outside
    that installation. Whatever directory on the way to one of them USER may
    not enter is opened up (_open_up): the paths stay the same, so the venv's
    pyvenv.cfg, sys.executable (which the engine starts its workers with)
    and every site directory work as they do for root."""
    opened = set()
    while True:  # one closed directory at a time, the outermost first
        closed = sorted({d for p in _interpreter_paths(python) for d in _closed_dirs(p)},
                        key=lambda d: d.count(os.sep))
        if not closed:
            break
        # a failure, not a skip: the kit itself no longer opens a directory up
        assert closed[0] not in opened, f"{closed[0]} is still closed after _open_up"
        _open_up(closed[0])
        opened.add(closed[0])
    # setpriv execs `python` with root's capabilities still in effect (they
    # go at that exec), so only an exec of the uid's own tells: the one the
    # engine makes of sys.executable for each worker.
    again = ("import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', "
             "'import numpy, posix_ipc, psutil']).returncode)")
    probe = subprocess.run(["setpriv", "--reuid", str(USER), "--regid", str(USER),
                            "--clear-groups", python, "-c", again],
                           capture_output=True, text=True, env=child_env())
    if probe.returncode != 0:
        raise CannotRun(f"uid {USER} cannot run {python} with its packages, even with the "
                        f"directories on its way opened up in a private mount namespace: "
                        f"{(probe.stderr or probe.stdout).strip()[-300:]}")
    return python


def _interpreter_paths(python: str) -> list:
    """What `python` reads at its start and imports from, as it says itself:
    the binary behind its symlinks, its prefixes (a venv's and the base
    installation's) and every directory on its sys.path."""
    code = ("import json, os, sys; print(json.dumps([sys.executable, os.path.realpath("
            "sys.executable), sys.prefix, sys.base_prefix, sys.exec_prefix, "
            "sys.base_exec_prefix, *[p for p in sys.path if os.path.isabs(p)]]))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=child_env(),
                         check=True).stdout
    paths = json.loads(out)
    return sorted({p for p in paths + [os.path.realpath(p) for p in paths] if os.path.exists(p)})


def _closed_dirs(path: str) -> list:
    """The directories on the way to `path` (it included, if a directory)
    that a uid neither owning them nor in their group cannot pass through."""
    closed, at = [], os.sep
    for part in path.strip(os.sep).split(os.sep):
        if not os.stat(at).st_mode & 0o001:
            closed.append(at)
        at = os.path.join(at, part)
        if os.path.islink(at):  # its target is on the list as a path of its own
            return closed
    if os.path.isdir(at) and not os.stat(at).st_mode & 0o001:
        closed.append(at)
    return closed


_MS_BIND, _MS_REC = 0x1000, 0x4000


def _mount(source: str, target: str, fstype=None, flags: int = 0, options=None) -> None:
    """mount(2) itself: one call per entry, where mount(8) would be a process each."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    args = [None if a is None else a.encode() for a in (source, target, fstype)]
    if libc.mount(*args, flags, None if options is None else options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _open_up(directory: str) -> None:
    """Show `directory` as mode 0755 in this mount namespace, with every entry
    it holds as it is: a tmpfs over it, and each entry bind-mounted from the
    original (reached through a descriptor opened before). Each entry keeps
    its own owner, mode, contents and writability (root's engines in the
    scenario may keep a store there); only passing through is opened."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        names = os.listdir(fd)
        _mount("tmpfs", directory, "tmpfs", 0, "mode=0755,size=1m")
        for name in names:
            target = os.path.join(directory, name)
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=fd), target)
                continue
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(target)
            else:
                open(target, "w").close()  # a mount point for a file, socket or FIFO
            _mount(f"/proc/self/fd/{fd}/{name}", target, None, _MS_BIND | _MS_REC)
    finally:
        os.close(fd)


def venv_user(args: dict) -> dict:
    """An engine of uid USER started from `python` (its workers with it):
    what it says, and what is left in /dev/shm after its close. Where uid
    USER cannot run this interpreter the test skips; where it can, but not
    `python` made from it, that is the answer (`cannot_run`) unless
    `may_skip`."""
    _user_python()
    try:
        python = _user_python(args["python"])
    except CannotRun as exc:
        if args.get("may_skip"):
            raise
        return {"cannot_run": str(exc)}
    out = _run(_as_uid(python, USER), "engine", {"store": args["store"], "pages": 8,
                                                 "workers": 1, "write": "v"})
    out["left"] = left_in_shm()
    return out


def _older_engines_leftovers() -> None:
    """A segment and a semaphore of a dead root owner with no lock file (an
    engine before decision 90): only its pid says it is dead."""
    import posix_ipc
    from shm import Segment, new_owner_tag
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tag = new_owner_tag(dead.pid)
    Segment.create(tag + ".pool", 4096).map.close()
    posix_ipc.Semaphore("/" + tag + ".done", posix_ipc.O_CREX, mode=0o600).close()


def small_shm(args: dict) -> dict:
    """Engines that cannot fit in this /dev/shm: the error, and what is left."""
    from faultkit import make
    out = []
    for case in args["cases"]:
        try:
            make(args["store"], geo=MID, **case).close()
            got = {"error": None}
        except Exception as exc:
            got = {"error": str(exc), "type": type(exc).__name__}
        got["left"] = left_in_shm()
        out.append(got)
    return {"cases": out}


def sglang_small_shm(args: dict) -> dict:
    """SGLang's attach, on the staging path (SGLang's default allocator) and on
    zero-copy (its shm allocator) with rings that do not fit."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang_pool import CpuMHAHostPool
    out = []
    for allocator, extra, leave in args["cases"]:
        pool = CpuMHAHostPool(layout="layer_first", allocator_type=allocator, pages=12)
        if leave:
            _fill_leaving(leave)
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
            model_name="m", extra_config={
                "backend_name": "hicache_mp", "module_path": "hicache_mp.integrations.sglang",
                "class_name": "HiCacheMP", "interface_v1": 1, "allocator": allocator,
                "storage_dir": args["store"], **extra})
        backend = None
        try:
            backend = StorageBackendFactory.create_backend("dynamic", config, pool)
            backend.register_mem_pool_host(pool)
            got = {"error": None}
        except Exception as exc:
            got = {"error": str(exc), "type": type(exc).__name__}
        finally:
            if backend is not None:
                backend.close()
            pool.close()
            if leave:
                os.unlink(FILLER)
        got["left"] = left_in_shm()
        out.append(got)
    return {"cases": out}


FILLER = "/dev/shm/filler"


def _fill_leaving(nbytes: int) -> None:
    """A file in /dev/shm that leaves about `nbytes` free (another program's)."""
    vfs = os.statvfs("/dev/shm")
    fd = os.open(FILLER, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, vfs.f_bavail * vfs.f_frsize - nbytes)
    finally:
        os.close(fd)


GROUP = 2000  # a group two engine uids share (no name needed: setpriv takes numbers)


def _as_uid(python: str, uid: int, groups=()) -> list:
    ids = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    return ["setpriv", "--reuid", str(uid), "--regid", str(uid), *ids, python]


def shared_store(args: dict) -> dict:
    """Engines of uids USER and USER + 1, both in GROUP, over one store whose
    root is root:GROUP 2770 (as Kubernetes' fsGroup or an operator makes a
    shared directory), one after the other: each reads what the other wrote,
    and the second overwrites a page of the first; a uid outside the group
    (USER + 2) reads and writes nothing. Returns each run and the mode and
    group of every directory and file in the store."""
    python = _user_python()
    store = args["store"]
    a, b = _as_uid(python, USER, [GROUP]), _as_uid(python, USER + 1, [GROUP])
    out = {"a": _run(a, "store_user", {"store": store, "write": ["a0", "a1", "a2"]})}
    out["b"] = _run(b, "store_user", {"store": store, "read": [["a0", 0], ["a1", 0], ["a2", 0]],
                                      "write": ["b0", "a1"], "version": 1})
    out["a_again"] = _run(a, "store_user", {"store": store, "read": [["b0", 1], ["a1", 1]]})
    out["stranger"] = _run(_as_uid(python, USER + 2), "store_user",
                           {"store": store, "read": [["a0", 0]], "write": ["c0"]})
    out["modes"] = []
    for d, _, files in os.walk(store):
        for path, kind in [(d, "dir")] + [(os.path.join(d, f), "file") for f in files]:
            st = os.stat(path)
            out["modes"].append([kind, os.path.relpath(path, store), st.st_mode & 0o7777,
                                 st.st_gid])
    out["left"] = left_in_shm()
    return out


def root_owned_store(args: dict) -> dict:
    """uid USER over a store directory root owns (0755): two backups."""
    out = _run(_as_uid(_user_python(), USER), "store_user",
               {"store": args["store"], "write": ["r0"], "twice": True})
    out["left"] = left_in_shm()
    return out


def store_user(args: dict) -> dict:
    """One engine over `store`: prefetches `read` ([key, version] pairs) and
    checks the bytes, then backs up `write` (version `version`; twice with
    `twice`); returns the statuses and every warning it logged."""
    import logging
    from faultkit import backup, content, get, make, prefetch
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    logging.getLogger("hicache_mp").addHandler(Keep(logging.WARNING))
    out = {"uid": os.getuid(), "groups": sorted(os.getgroups())}
    with make(args["store"], geo=MID, pages=8, workers=1) as e:
        pb = e.geometry.page_bytes
        read = args.get("read", [])
        if read:
            op = prefetch(e, [k for k, _ in read], range(4, 4 + len(read)))
            out["read"] = [int(s) for s in op.page_status]
            out["bytes"] = [get(e, 4 + i) == content(k, pb, version=v)
                            for i, (k, v) in enumerate(read)]
        for _ in range(2 if args.get("twice") else 1):
            keys = args.get("write", [])
            if keys:
                op = backup(e, keys, range(len(keys)), version=args.get("version", 0))
                out.setdefault("wrote", []).append([int(s) for s in op.page_status])
    out["warnings"] = seen
    return out


def engine(args: dict) -> None:
    """One engine: checks the page the previous run wrote (bytes), backs up its
    own; READY; then waits to be killed (`stay`) or closes."""
    from faultkit import backup, content, get, make, prefetch
    e = make(args["store"], geo=args.get("geo", MID), pages=args["pages"], workers=args["workers"])
    info = {"pid": os.getpid(), "stale_removed": len(e.stale_removed),
            "workers": e.worker_count(), "python": sys.executable}
    if args.get("read"):
        op = prefetch(e, [args["read"]], [1])
        info["read_ok"] = bool(op.ok_pages == 1 and get(e, 1) == content(args["read"], e.geometry.page_bytes))
    op = backup(e, [args["write"]], [0])
    info["wrote"] = op.status
    op = prefetch(e, [args["write"]], [2])  # and back, into another slot
    info["own_ok"] = bool(op.ok_pages == 1 and get(e, 2) == content(args["write"], e.geometry.page_bytes))
    print("READY " + json.dumps(info), flush=True)
    if args.get("stay"):
        time.sleep(3600)
    e.close()
    print("RESULT " + json.dumps(info), flush=True)


if __name__ == "__main__":
    sys.path[:0] = PATH.split(os.pathsep)
    role, given = sys.argv[1], json.loads(sys.argv[2])
    try:
        got = globals()[role](given)
    except CannotRun as exc:
        got = {"skip": str(exc)}
    if got is not None:
        print("RESULT " + json.dumps(got), flush=True)
