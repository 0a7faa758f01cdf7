"""The in-memory index of pages present in the store.

Owns the answer to `exists` without syscalls: a set of key digests, filled by
a scan at start (and on `refresh()`), kept current by successful backups.
The scan also removes temp files whose writer is dead, so a crashed writer
leaves nothing behind (another host's writer: once its temp file is an hour
old, since its pid cannot be checked from here). Must not read page contents.
"""
import os
import time

from shm.names import pid_alive
from workers import naming
from workers.storedir import fanout_dirs


class StoreIndex:
    def __init__(self, root: str):
        self.root = root
        self.digests: set[bytes] = set()
        self.stale_tmp_removed = 0

    def scan(self) -> int:
        """Rebuild from the directory tree; returns the page count."""
        found = set()
        for sub in fanout_dirs(self.root):
            try:
                names = os.listdir(sub)
            except OSError:
                continue
            for name in names:
                digest = naming.digest_from_name(name)
                if digest is not None:
                    found.add(digest)
                    continue
                writer = naming.tmp_owner(name)
                if writer is not None and _stale_tmp(os.path.join(sub, name), name, writer):
                    try:
                        os.unlink(os.path.join(sub, name))
                        self.stale_tmp_removed += 1
                    except OSError:
                        pass
        self.digests = found
        return len(found)

    def add(self, digest: bytes) -> None:
        self.digests.add(digest)

    def discard(self, digest: bytes) -> None:
        self.digests.discard(digest)

    def __len__(self) -> int:
        return len(self.digests)


# A writer on another host is judged by its temp file's age, not its pid: no
# page write takes this long, and its pid means nothing here.
FOREIGN_TMP_STALE_S = 3600.0


def _stale_tmp(path: str, name: str, writer: int) -> bool:
    host = naming.tmp_host(name)
    if host is None or host == naming.host_tag():
        return not pid_alive(writer)
    try:
        return time.time() - os.stat(path).st_mtime > FOREIGN_TMP_STALE_S
    except OSError:
        return False

