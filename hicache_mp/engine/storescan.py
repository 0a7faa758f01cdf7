"""StoreScan: the `mp` engine's scans of the store, taken into the index a share per poll.

Owns when a scan starts (once the workers are ready, so the constructor
returns whatever the store holds; again for a rescan, after the one running),
taking the scanner's records off its ring into the index, at most
TAKE_PER_POLL per drain, and telling a scanner that died from one that
finished. Must not walk the store (workers.scanner does, in its own process)
nor decide what the index believes of a digest (hicache_mp.engine.index:
add_scanned, the scan's state and whether the index is whole).

Why a share per poll: each digest taken costs this thread about 0.35 µs of
Python (a bytes slice and a set insert), so a million pages cost ~0.35 s of
the scheduler's time in all. Taken at once that would be one long step; a
share of TAKE_PER_POLL costs ~0.35 ms and a million pages are in after
~1,000 polls. Until then the index is not whole, and exists() asks the
workers about every key it does not know and waits for their answers
(hicache_mp.engine.lookups), so no page the scan has not reached yet reads
as a miss.

Runs inside poll() on the scheduler's thread, under the engine's lock.
"""
import logging
import time

import numpy as np

from shm.ring import RECORD_DTYPE
from workers.records import KIND_SCAN_END
from workers.scanner import ScannerProcess
from workers.timing import HEALTH_CHECK_S

from .index import StoreIndex

log = logging.getLogger("hicache_mp")

TAKE_PER_POLL = 1024
_SIZE = RECORD_DTYPE.itemsize
_KIND_AT = RECORD_DTYPE.fields["kind"][1]
_DIGEST_AT = RECORD_DTYPE.fields["digest"][1]
_END = bytes([KIND_SCAN_END])


class StoreScan:
    """`scanner`: the scanner processes' handle and ring (made with the
    engine's segments); `index`: where what they list goes."""

    def __init__(self, scanner: ScannerProcess, index: StoreIndex):
        self.scanner, self.index = scanner, index
        self.again = False         # a rescan asked for while one ran
        self.launch = False        # a scan begun whose scanner waits for the last one to exit
        self._looked_at = 0.0      # when take() last asked whether the scanner lives

    def start(self, store=None) -> None:
        """Begin a scan now (none running): the index is scanning from here
        on. The ring has one producer: a scanner that sent its end record but
        has not exited yet is let go first, and a later poll launches the next.
        `store` (at start): a store with no fan-out directory at all holds no
        page nor temp file, and is scanned whole with one listing here, no
        process (a fresh store: most engines' first start, every test's)."""
        self.again = False
        self.index.begin_scan()
        if store is not None and store.blank():
            self.index.end_scan(whole=True, stale_removed=0)
            return
        self.launch = self.scanner.running()
        if not self.launch:
            self.scanner.start()

    def rescan(self) -> None:
        """A scan of the store after the one running, if any (a rescan asked
        for by the settings, by refresh() or by a dead worker's temp files)."""
        if self.index.scanning:
            self.again = True
        else:
            self.start()

    def take(self) -> int:
        """Move up to TAKE_PER_POLL listed pages into the index; the count."""
        if not self.index.scanning:
            if not self.scanner.exited() and self._look():
                self.scanner.running()  # collects a finished scanner: no zombie left
            return 0
        if self.launch:
            if self._look() and not self.scanner.running():
                self.launch = False
                self.scanner.start()
            return 0
        raw = self.scanner.ring.pop_bytes(TAKE_PER_POLL)
        if not raw:
            self._check_alive()
            return 0
        end = raw[_KIND_AT::_SIZE].find(_END)
        body = raw if end < 0 else raw[:end * _SIZE]
        self.index.add_scanned([body[o:o + 32] for o in range(_DIGEST_AT, len(body), _SIZE)])
        if end >= 0:
            rec = np.frombuffer(raw, dtype=RECORD_DTYPE, count=1, offset=end * _SIZE)[0]
            self.index.end_scan(whole=True, stale_removed=int(rec["op_id"]))
            if self.again:
                self.start()
        return len(body) // _SIZE

    def _look(self) -> bool:
        """May we ask whether the scanner lives? At most every HEALTH_CHECK_S:
        each look is a waitpid."""
        now = time.monotonic()
        if now - self._looked_at < HEALTH_CHECK_S:
            return False
        self._looked_at = now
        return True

    def _check_alive(self) -> None:
        """The ring is empty: a scanner that exited without its end record
        died (killed, out of memory). What it listed stays in the index; the
        index is not whole, so exists() keeps asking the workers, and the next
        rescan starts another."""
        if not self._look() or self.scanner.running():
            return
        if self.scanner.ring.pending():  # its end record landed after our pop
            return
        log.warning("hicache_mp-scanner (pid %s) exited with code %s before its scan of the "
                    "store ended; the index holds the %d pages it listed, and keys it does not "
                    "know are asked of the store", self.scanner.pid, self.scanner.returncode,
                    self.index.scan_pages)
        self.index.end_scan(whole=False, stale_removed=0)
        if self.again:
            self.start()
