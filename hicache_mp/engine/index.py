"""The in-memory index of pages present in the store.

Owns the answer to `exists` without syscalls: a set of key digests, filled by
a scan of the store (at start: in the background for the `mp` engine,
hicache_mp.engine.storescan; in the constructor for the in-process
baselines; and on `refresh()`), kept current by successful backups; and what
the scans have told it: whether one runs, how many pages it listed, and
whether the index is whole (`complete`: a scan has ended whole, so a key
it misses was not in the store when that scan began). While a scan runs, a
page found gone (a miss, an eviction) is remembered, so the scan's older
listing of it does not bring it back. A page a read found damaged or could
not read (unreadable: EACCES, EIO) is distrusted for DAMAGED_TTL_S: a probe
or rescan finds its file again by name and size, and believing it would
claim the prefix on every call and skip the backup that repairs it. The
scan also removes temp files whose writer is gone (workers.tmpfiles says
when that is known), so a crashed writer leaves nothing behind. Must not
read page contents.
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
        self.complete = False      # a scan has ended whole
        self.scanning = False      # a scan has begun and not ended
        self.scans = 0             # scans begun
        self.scan_pages = 0        # pages the latest scan listed so far
        self.scan_whole = False    # the latest scan ended whole
        self._scan_t = (0.0, 0.0)  # the latest scan's start and end (monotonic; end 0: running)
        self._gone: set = set()    # found gone while a scan runs: its listing is older

    def scan(self) -> int:
        """Walk the store on this thread and add what it holds; returns the
        page count. (The `mp` engine scans in a process of its own instead.)"""
        self.begin_scan()
        found = self.store.scan(reap_tmp=True)
        self.add_scanned([page.digest for page in found.pages])
        self.end_scan(whole=True, stale_removed=found.stale_removed)
        return len(self.digests)

    def begin_scan(self) -> None:
        self.scanning, self.scans, self.scan_pages = True, self.scans + 1, 0
        self._scan_t = (time.monotonic(), 0.0)
        self._gone = set()

    def end_scan(self, whole: bool, stale_removed: int) -> None:
        """The scan ended: `whole`, it listed the entire store."""
        self.scanning, self.scan_whole = False, whole
        self.complete = self.complete or whole
        self.stale_tmp_removed += stale_removed
        self._scan_t = (self._scan_t[0], time.monotonic())
        self._gone = set()

    def scan_metrics(self) -> dict:
        """metrics()["store_scan"]: the latest scan's state, pages listed and
        seconds (so far, while it runs), and whether the index is whole."""
        start, end = self._scan_t
        state = "scanning" if self.scanning else "done" if self.scan_whole else \
            "failed" if self.scans else "none"
        return {"state": state, "complete": self.complete, "pages": self.scan_pages,
                "seconds": round((end or time.monotonic()) - start, 3) if self.scans else 0.0,
                "scans": self.scans}

    def add(self, digest: bytes) -> None:
        """A page this process wrote (or was told of): trusted, damaged or not before."""
        self.digests.add(digest)
        if self.damaged:
            self.damaged.pop(digest, None)
        if self._gone:
            self._gone.discard(digest)

    def add_found(self, digest: bytes) -> None:
        """A page a probe found: unless a read found that file damaged lately."""
        if self.damaged and self._distrusted(digest):
            return
        self.digests.add(digest)
        if self._gone:
            self._gone.discard(digest)

    def add_scanned(self, digests, listed: bool = True) -> None:
        """Pages a scan listed, the distrusted ones left out, and those found
        gone since the scan began (its listing may predate the removal).
        `listed`: count them as the running scan's (not for refresh()'s own walk)."""
        if listed:
            self.scan_pages += len(digests)
        if self.damaged:
            digests = [d for d in digests if not self._distrusted(d)]
        if self._gone:
            digests = [d for d in digests if d not in self._gone]
        self.digests.update(digests)

    def discard(self, digest: bytes, damaged: bool = False) -> None:
        """A read found no usable page (`damaged`: its file is there but bad),
        or the evictor removed it."""
        self.digests.discard(digest)
        if self.scanning:
            self._gone.add(digest)
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
