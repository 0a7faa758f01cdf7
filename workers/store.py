"""The page-store seam: what a worker, the evictor, the index and clear() may ask of a store.

Owns the interface (`PageStore`), the settings a store's I/O follows
(`StoreIO`), the free-space helper, the `storage_dir` syntax, the
mode of a store's directories, the error for one that cannot be made
(`StoreDirError`) and the words for one this user cannot write
(`write_problem`). Must not know about rings, ops, the pool
layout or torch, nor which stores exist (workers.stores, the factory, names
them and imports this module): a store moves one page between iovecs and its
medium and says how that went, as a status code (workers.status).

The calls, all synchronous and safe from several threads of one process:

    read(digest, iovecs, bufs)   -> (status, errno)   bytes of the page into iovecs
    write(digest, iovecs, bufs)  -> (status, errno)   the page from iovecs, atomically
    remove(digest) -> bool                            True: the page is gone (or was)
    touch(digest)                                     mark it just used (LRU)
    exists(digest) -> bool                            one lookup, no walk
    scan(reap_tmp=False) -> Scan                      every page: digest, size, last access
    walk(reap_tmp=False) -> iter of (digests, reaped) every page's digest, a directory at a
                                                      time, with no stat per page
    blank() -> bool                                   no page, nor any directory one
                                                      would be in: one listing
    free_bytes(digest=None) -> int | None             room left where that page goes
    parts() -> [PageStore]                            the independently full/failing pieces
    roots                                             directories the store lives in

`bufs` carries the per-thread scratch the file format needs (`header`,
`overflow`, `write_header`: workers.lanes.Lane), and `gate`: None, or a
callable a store may call between pieces of a buffered write, where the
worker may pause it while reads wait (a store that writes whole ignores it). An asynchronous store
(io_uring) would add a submit/reap pair beside read/write; the worker's
`serve` is already split into a start and a completion half for it.

A store is opened by `workers.stores.open_store(storage_dir, io)`.
"""
import errno
import os
import shlex
import stat
from dataclasses import dataclass
from typing import NamedTuple

# The owner's bits of every directory a store makes (its roots, fan-out
# levels, quarantine). A root it makes is owner-only; a directory below copies
# its parent's group bits as well where the parent is setgid, never others'
# (workers.filestore, decision 100): a store stays private unless its root was
# made group-shared.
DIR_MODE = 0o700


@dataclass(frozen=True)
class StoreIO:
    """How a store reads and writes pages for one engine (set by the engine)."""
    payload_len: int = 0
    geometry_fp: bytes = b""
    direct: bool = False
    fsync: str = "none"
    write_crc: bool = False
    verify_crc: bool = True
    require_crc: bool = False
    quarantine: bool = False


class Page(NamedTuple):
    stamp_ns: int   # last access (mtime, stamped after each read) in ns since the epoch
    size: int
    digest: bytes


class Scan(NamedTuple):
    pages: list          # [Page]
    total_bytes: int     # page files and temp files: what the store holds
    stale_removed: int   # temp files of dead writers removed (reap_tmp)
    temps: tuple = ()    # ((file name, size), ...): the temp files in total_bytes


class StoreDirError(OSError, ValueError):
    """A store directory that cannot be made: the path is a file, lies under a
    file, or sits where this user (or the filesystem) allows no directory.

    Raised when the engine opens its store, before any worker or segment
    exists, naming the setting, the path, the reason and the fix. An OSError
    (its errno is the cause's) and a ValueError too, as ShmFullError is: a
    setting that cannot work here, refused as a bad value is."""

    def __init__(self, path: str, cause: OSError):
        code = cause.errno
        if os.path.lexists(path) and not os.path.isdir(path):
            code = errno.ENOTDIR  # makedirs says "File exists", which hides the cause
        reason = os.strerror(code) if code else str(cause)
        self.path, self.reason = path, reason
        super().__init__(code, f"storage_dir {path!r} cannot be used as a page store directory: "
                               f"{reason}. Fix: set storage_dir "
                               f"(\"storage_dir\" in the framework's extra config, or "
                               f"--storage-dir) to a directory this user can create and write, "
                               f"or create it beforehand")


class PageStore:
    roots: list

    def read(self, digest: bytes, iovecs, bufs, ranges=None) -> tuple[int, int]:
        """The page into `iovecs`: the whole payload, or with `ranges` (payload
        offset, length) only those runs, in order (a layer group, decision 101)."""
        raise NotImplementedError

    def write(self, digest: bytes, iovecs, bufs) -> tuple[int, int]:
        raise NotImplementedError

    def remove(self, digest: bytes) -> bool:
        raise NotImplementedError

    def touch(self, digest: bytes) -> None:
        raise NotImplementedError

    def exists(self, digest: bytes) -> bool:
        raise NotImplementedError

    def scan(self, reap_tmp: bool = False) -> Scan:
        raise NotImplementedError

    def walk(self, reap_tmp: bool = False):
        raise NotImplementedError

    def blank(self) -> bool:
        raise NotImplementedError

    def free_bytes(self, digest: bytes | None = None) -> int | None:
        raise NotImplementedError

    def parts(self) -> list:
        return [self]

    def remember_leaves(self) -> None:
        """Reads may keep what they open for the next (FileStore's leaf directories)."""
        for part in self.parts():
            if part is not self:
                part.remember_leaves()

    def close(self) -> None:
        """Let go of what reads keep open."""
        for part in self.parts():
            if part is not self:
                part.close()

    def create(self) -> None:
        """Make the store's directories (owner-only) if they are missing;
        StoreDirError for one that cannot be made. A directory that exists but
        cannot be written is left to serve reads (decision 49): its writes end
        `denied`, one at a time."""
        for root in self.roots:
            try:
                os.makedirs(root, mode=DIR_MODE, exist_ok=True)
            except OSError as exc:
                raise StoreDirError(root, exc) from None



def write_problem(root: str) -> str | None:
    """Why this process cannot make pages in the existing store directory
    `root`, in words that name the directory and the fix; None where it can,
    or where `root` is missing (create() makes it then). The engine says it
    once at start: every write that fails still ends `denied`, page by page,
    counted in metrics(), and logged once per cause without a path."""
    try:
        st = os.stat(root)
    except OSError:
        return None
    try:
        if os.statvfs(root).f_flag & os.ST_RDONLY:
            return (f"storage_dir {root!r} is on a read-only filesystem: pages there are read, "
                    f"and every backup ends `denied`. Fix: mount it read-write (or nothing, "
                    f"for a store this server only reads)")
    except OSError:
        pass
    if os.access(root, os.W_OK | os.X_OK, effective_ids=True):
        return None
    uid, gid, q = os.geteuid(), os.getegid(), shlex.quote(root)
    reads = os.access(root, os.R_OK | os.X_OK, effective_ids=True)
    what = (f"storage_dir {root!r} is not writable by this engine (uid {uid}, gid {gid}; the "
            f"directory is owned by uid {st.st_uid}, gid {st.st_gid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}): "
            f"{'pages already there are read, but' if reads else 'no page there is read, and'} "
            f"every backup ends `denied`. Fix: ")
    if st.st_mode & stat.S_ISGID and st.st_mode & stat.S_IWGRP:
        # A store shared by group (decision 100) that this uid is not a member of.
        return what + (f"run the engine with group {st.st_gid} among its groups (Kubernetes "
                       f"securityContext.supplementalGroups or fsGroup, docker run --group-add "
                       f"{st.st_gid}), or as the directory's owner (uid {st.st_uid})")
    return what + (f"give this uid the directory (`chown -R {uid} {q}`), or share it by group "
                   f"with a group this uid is in (`chgrp -R <group> {q} && chmod -R g+rwX {q} "
                   f"&& find {q} -type d -exec chmod g+s {{}} +`; decision 100), or run the "
                   f"engine as the directory's owner (uid {st.st_uid})")


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on `path`'s filesystem; None if unknown."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def split_dirs(storage_dir: str) -> list[str]:
    """The directories a `storage_dir` names: one, or a comma-separated list."""
    parts = [p.strip() for p in str(storage_dir).split(",")]
    if not all(parts):
        raise ValueError(f"storage_dir {storage_dir!r} has an empty entry")
    return parts


def normalize_dirs(storage_dir: str) -> str:
    """`storage_dir` with each directory absolute and expanded; ValueError for a bad list."""
    dirs = [os.path.abspath(os.path.expanduser(p)) for p in split_dirs(storage_dir)]
    if len(set(dirs)) != len(dirs):
        raise ValueError(f"storage_dir {storage_dir!r} names a directory twice")
    return ",".join(dirs)

