"""The store scanner: lists every page of the store for the engine's index, in a process of its own.

Runs as a short-lived child (``python -m workers.scanner hicache_mp-scanner
'<json>'``), started by the engine once its workers are ready and again for
a rescan, so the engine's constructor returns whatever the store holds and
no thread of the scheduler's process walks the store. A walk is one listing
per fan-out directory (65,536 of them in a full store) and a name check per
entry; a million page files take tens of seconds of it, and more on a
shared filesystem, where each listing is a round trip. In the scheduler's
process that is seconds of a GIL-holding thread, which is the starvation
this project exists to end (docs/design.md §1).

    engine (scheduler's process)                 scanner
    ----------------------------                 -------
    ScannerProcess.start() ───── Popen ────────► walk the store (PageStore.walk: names,
                                                   no stat per page; temp files of dead
                                                   writers removed)
    poll(): scan_ring.pop_bytes(a share) ◄─────── push (KIND_SCAN, digest) per page,
      the index adds them                          waiting while the ring is full
    the scan is whole ◄────────────────────────── push (KIND_SCAN_END, io_ns = pages,
                                                   op_id = temp files removed); exit 0

The ring is ordered: every page listed is before the end record, so the
engine knows the index holds what the walk found once it has taken that
record. The scanner stops at STOP (the engine's close) and when its parent
is gone; it unlinks nothing: the workers, alive as long as it, carry the
ring's name among the names an orphan unlinks.

Must not open page files, read their contents or remove anything but the
temp files workers.tmpfiles calls stale; nor decide what the index believes
(the engine does: hicache_mp.engine.storescan).
"""
import json
import os
import sys
import time

import numpy as np

from shm import Ring
from shm.ring import RECORD_DTYPE
from workers.child import Child, ParentWatch, child_main
from workers.control import SCANNER_PID, STOP, Control
from workers.records import KIND_SCAN, KIND_SCAN_END
from workers.stores import open_store
from workers.timing import SCAN_PUSH_POLL_S, STOP_GRACE_S

# Records on the scan ring: 4096 of 64 bytes, 256 KiB of /dev/shm. The engine
# takes a share per poll (hicache_mp.engine.storescan.TAKE_PER_POLL), so a ring
# of a few shares keeps the walk going between polls.
SCAN_RING_CAPACITY = 4096


class Scanner:
    def __init__(self, cfg: dict):
        self.store = open_store(cfg["storage_dir"])
        self.parent = ParentWatch(cfg["parent_pid"])
        self.control = Control(cfg["control"], create=False)
        self.ring = Ring(cfg["scan_ring"], cfg["scan_ring_capacity"], create=False)

    def run(self) -> int:
        self.control.words[SCANNER_PID] = os.getpid()
        pages = reaped = 0
        for digests, removed in self.store.walk(reap_tmp=True):
            reaped += removed
            if digests:
                recs = np.zeros(len(digests), dtype=RECORD_DTYPE)
                recs["kind"] = KIND_SCAN
                recs["digest"] = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(-1, 32)
                if not self._push(recs):
                    return 0
                pages += len(digests)
            elif self._stopped():
                return 0
        end = np.zeros(1, dtype=RECORD_DTYPE)
        end["kind"] = KIND_SCAN_END
        end["io_ns"] = pages
        end["op_id"] = reaped
        self._push(end)
        return 0

    def _stopped(self) -> bool:
        return self.control.stopping() or self.parent.gone()

    def _push(self, recs: np.ndarray) -> bool:
        """All of `recs` onto the ring, waiting for room; False if told to stop first."""
        while len(recs):
            recs = recs[self.ring.push(recs):]
            if len(recs):
                if self._stopped():
                    return False
                time.sleep(SCAN_PUSH_POLL_S)
        return True


# --- the engine's side: the ring, start, stop -----------------------------------------
class ScannerProcess:
    """The engine's handle on its store scans: the ring they report on (made
    with the engine's segments) and the current scanner, if any. One scanner
    at a time: the ring has one producer."""

    def __init__(self, *, tag: str, control: Control, storage_dir: str):
        self.control = control
        self.ring = Ring(tag + ".scan", SCAN_RING_CAPACITY, create=True)
        self.cfg = {"storage_dir": storage_dir, "parent_pid": os.getpid(),
                    "control": control.name, "scan_ring": self.ring.name,
                    "scan_ring_capacity": SCAN_RING_CAPACITY}
        self.child = None

    def start(self) -> None:
        """Launch a scanner; the last one must have exited (`running()` False)."""
        self.control.words[SCANNER_PID] = 0
        self.child = Child("workers.scanner", "hicache_mp-scanner", json.dumps(self.cfg),
                           ready_word=lambda: self.control.words[SCANNER_PID])

    def running(self) -> bool:
        """A scanner was launched and has not exited (reaped once it has)."""
        return self.child is not None and self.child.alive()

    def exited(self) -> bool:
        """No scanner was launched, or the last one's exit has been collected."""
        return self.child is None or self.child.returncode is not None

    @property
    def pid(self) -> int | None:
        return None if self.child is None else self.child.pid

    @property
    def returncode(self):
        return None if self.child is None else self.child.returncode

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """End the scanner (killed: below) and reap it, then unlink the ring."""
        if self.child is not None:
            self.control.words[STOP] = 1
            # It holds nothing a kill could tear: its listing goes nowhere now,
            # and a temp file it was removing is removed or not. Waiting would
            # cost a close() the scanner's interpreter start when it is young.
            self.child.kill()
            self.child.stop(time.monotonic() + grace_s)
            self.child = None
        self.ring.close()


def main(argv: list[str]) -> int:
    return child_main(argv, json.loads, lambda cfg: Scanner(cfg).run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
