"""The in-memory index of pages present in the store.

Owns the answer to `exists` without syscalls: a set of key digests, filled by
a scan of the store at start (and on `refresh()`), kept current by successful
backups. A page a read found damaged or could not read (unreadable: EACCES,
EIO) is distrusted for DAMAGED_TTL_S: a
probe or rescan finds its file again by name and size, and believing it
would claim the prefix on every call and skip the backup that repairs it. The scan also removes temp files whose writer is gone
(workers.tmpfiles says when that is known), so a crashed writer leaves
nothing behind. Must not read page contents.
"""
import time

from workers.store import PageStore
from workers.stores import open_store
from workers.timing import DAMAGED_TTL_S


class StoreIndex:
    def __init__(self, store: PageStore | str):
        self.store = open_store(store) if isinstance(store, str) else store
        self.digests: set[bytes] = set()
        self.damaged: dict[bytes, float] = {}   # digest -> when a read found its file damaged
        self.stale_tmp_removed = 0

    def scan(self) -> int:
        """Rebuild from the store; returns the page count."""
        found = self.store.scan(reap_tmp=True)
        self.digests = {page.digest for page in found.pages}
        self.stale_tmp_removed += found.stale_removed
        return len(self.digests)

    def add(self, digest: bytes) -> None:
        """A page this process wrote (or was told of): trusted, damaged or not before."""
        self.digests.add(digest)
        if self.damaged:
            self.damaged.pop(digest, None)

    def add_found(self, digest: bytes) -> None:
        """A page a probe found: unless a read found that file damaged lately."""
        if self.damaged and self._distrusted(digest):
            return
        self.digests.add(digest)

    def add_scanned(self, digests: set) -> None:
        """Pages a rescan found, the distrusted ones left out."""
        if self.damaged:
            digests = {d for d in digests if not self._distrusted(d)}
        self.digests |= digests

    def discard(self, digest: bytes, damaged: bool = False) -> None:
        """A read found no usable page; `damaged`: its file is there but bad."""
        self.digests.discard(digest)
        if damaged:
            self.damaged[digest] = time.monotonic()

    def _distrusted(self, digest: bytes) -> bool:
        at = self.damaged.get(digest)
        if at is None:
            return False
        if time.monotonic() - at < DAMAGED_TTL_S:
            return True
        del self.damaged[digest]
        return False

    def __len__(self) -> int:
        return len(self.digests)
