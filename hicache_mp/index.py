"""The in-memory index of pages present in the store.

Owns the answer to `exists` without syscalls: a set of key digests, filled by
a scan of the store at start (and on `refresh()`), kept current by successful
backups. The scan also removes temp files whose writer is gone
(workers.tmpfiles says when that is known), so a crashed writer leaves
nothing behind. Must not read page contents.
"""
from workers.store import PageStore
from workers.stores import open_store


class StoreIndex:
    def __init__(self, store: PageStore | str):
        self.store = open_store(store) if isinstance(store, str) else store
        self.digests: set[bytes] = set()
        self.stale_tmp_removed = 0

    def scan(self) -> int:
        """Rebuild from the store; returns the page count."""
        found = self.store.scan(reap_tmp=True)
        self.digests = {page.digest for page in found.pages}
        self.stale_tmp_removed += found.stale_removed
        return len(self.digests)

    def add(self, digest: bytes) -> None:
        self.digests.add(digest)

    def discard(self, digest: bytes) -> None:
        self.digests.discard(digest)

    def __len__(self) -> int:
        return len(self.digests)
