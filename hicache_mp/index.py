"""The in-memory index of pages present in the store.

Owns the answer to `exists` without syscalls: a set of key digests, filled by
a scan at start (and on `refresh()`), kept current by successful backups.
The scan also removes temp files whose writer is dead, so a crashed writer
leaves nothing behind. Must not read page contents.
"""
import os

from shm.names import pid_alive
from workers import naming


class StoreIndex:
    def __init__(self, root: str):
        self.root = root
        self.digests: set[bytes] = set()
        self.stale_tmp_removed = 0

    def scan(self) -> int:
        """Rebuild from the directory tree; returns the page count."""
        found = set()
        for top in _subdirs(self.root):
            for sub in _subdirs(top):
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
                    if writer is not None and not pid_alive(writer):
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

    def leading(self, digests) -> int:
        n = 0
        for d in digests:
            if d not in self.digests:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self.digests)


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
