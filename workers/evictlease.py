"""The eviction lease: at most one evictor at a time removes pages from a shared store.

Owns the lease file ``<store>/.evict-lease``. Must not remove pages or decide
how many: the evictor (workers.evictor) does, while it holds the lease.

Why: `storage_max_bytes` is the size of the shared store. Every engine's
evictor measures the whole store (its scan sees every node's files), so when
the store nears the limit every evictor sees it at once; if each then removed
what it judged was needed, N nodes would together remove N times too much and
leave the store far below its limit (a cache emptied for nothing). With the
lease, an evictor that finds eviction needed takes the lease, scans again
(another evictor may just have made room), removes only what that fresh scan
says, and gives the lease back. An evictor that cannot take it skips this
pass: the holder is making room for everyone.

The file is created with O_CREAT|O_EXCL (atomic on every POSIX filesystem a
store may live on: local, NFSv3+, Lustre, CephFS, JuiceFS, 3FS) and holds a
random token. It expires LEASE_S after its last refresh (its mtime, refreshed
by the holder during a long pass), so a holder that died is replaced without
any pid check, which would mean nothing on another node. An expired lease is
renamed aside to a unique name and then removed: of several evictors that
judged it expired, one rename wins. A holder checks its token is still in the
file before each batch of removals and stops if it is not; the one remaining
race (a lease judged expired just as it was renewed) lets two evictors run one
pass together: more eviction than needed once, never wrong bytes.
"""
import os
import secrets
import time

from workers.timing import LEASE_S

LEASE_NAME = ".evict-lease"


class Lease:
    def __init__(self, root: str, token: bytes, fd_path: str):
        self.root = root
        self.token = token
        self.path = fd_path

    def held(self) -> bool:
        """Is the lease still ours? Refreshes it when it is."""
        try:
            with open(self.path, "rb") as f:
                if f.read(64) != self.token:
                    return False
            os.utime(self.path)
            return True
        except OSError:
            return False

    def release(self) -> None:
        try:
            with open(self.path, "rb") as f:
                mine = f.read(64) == self.token
            if mine:
                os.unlink(self.path)
        except OSError:
            pass


def take(root: str, now: float | None = None) -> Lease | None:
    """The lease if this caller may evict now, else None (another evictor holds it)."""
    path = os.path.join(root, LEASE_NAME)
    token = secrets.token_hex(16).encode()
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            if not _break_expired(path, now):
                return None
            continue
        except OSError:
            return None  # cannot create it (read-only store...): nothing to evict either
        try:
            os.write(fd, token)
        finally:
            os.close(fd)
        lease = Lease(root, token, path)
        return lease if lease.held() else None
    return None


def _break_expired(path: str, now: float | None) -> bool:
    """Remove the lease if it expired; True if the caller may try to take it."""
    try:
        age = (time.time() if now is None else now) - os.stat(path).st_mtime
    except FileNotFoundError:
        return True  # released meanwhile
    except OSError:
        return False
    if age < LEASE_S:
        return False
    aside = f"{path}.expired.{secrets.token_hex(8)}"
    try:
        os.rename(path, aside)
    except OSError:
        return False  # another evictor broke it first; it holds the lease now or soon
    try:
        os.unlink(aside)
    except OSError:
        pass
    return True
