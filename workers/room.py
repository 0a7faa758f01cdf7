"""Room at the limit: a write that would cross a storage limit waits briefly for the evictor.

Owns the wait of one worker's writes at `storage_max_bytes` (or the
`storage_min_free_bytes` floor) and the worker's WANT word (workers.control).
Must not evict or decide how much: the evictor (workers.evictor) does, and it
reads WANT to know how much more than its hysteresis to free. Must not write
bytes: the worker's write goes on once this says there is room.

Why: a cache at its limit must make room for new pages by evicting the least
recently used ones; refusing every new page there keeps stale content and
misses all that is new. The evictor frees only its hysteresis band per pass
(a few pages of a small store), so a burst of new pages larger than the band
used to land a band's worth per pass and drop the rest. Now a write whose
reservation crosses a limit keeps its reservation (the evictor's snapshot
counts it as held, workers.inflight), says in WANT how many more writes of
its worker wait behind the limit (its write ring's queue, and other lanes'
writes waiting), wakes the evictor, and looks every ROOM_POLL_S whether the estimate has come down.

It gives up (the write is dropped, as before) when:
  - ROOM_WAIT_S has passed, or the op was cancelled, or the worker stops;
  - a pass that began after it asked has ended with no page removed (all
    pinned, another engine's evictor holds the lease, or a floor that only
    other files fill): no room is coming, so it does not sit out the bound.
After a wait that got no room, this worker's writes at the limit are refused
at once for ROOM_WAIT_S, so a store that cannot make room sheds backups at the
door as before instead of holding every one for the bound.

The wait runs on the write's own lane thread, never on the scheduler's: the
engine's calls stay non-blocking (a backup's pages just finish later), reads
keep being served beside it, and the time waited is a pause, not I/O
(`lane.paused_ns`: the write share is not charged for it).
"""
import threading
import time

from workers.control import EVICT_PASSES, EVICT_REMOVED, WANT
from workers.timing import ROOM_POLL_S, ROOM_WAIT_S


class Room:
    """One worker's writes waiting at a limit (several lanes may wait at once)."""

    def __init__(self, control, stats, evict_wake, file_bytes: int, queued):
        self.words = control.words
        self.stats = stats          # this worker's row of the control block
        self.evict_wake = evict_wake
        self.file_bytes = file_bytes
        self.queued = queued        # () -> writes queued on this worker's ring
        self._lock = threading.Lock()
        self._waiting = 0
        self._refuse_until = 0.0
        self.waits = self.got_room = 0

    def wait(self, over, give_up, lane) -> bool:
        """Wait for `over()` to turn False (True: the write may go); False at
        once, or when one of the module's reasons to give up is met."""
        t0 = time.monotonic()
        if self.evict_wake is None or t0 < self._refuse_until:
            return False
        self.waits += 1
        asked = int(self.words[EVICT_PASSES])
        seen = asked
        self._enter(1)
        try:
            self.evict_wake.post()
            deadline = t0 + ROOM_WAIT_S
            while True:
                time.sleep(ROOM_POLL_S)
                # PASSES before the estimate: the evictor publishes a pass's scan
                # before it counts the pass, so a pass seen ended is in `over()`.
                passes = int(self.words[EVICT_PASSES])
                removed = int(self.words[EVICT_REMOVED])
                if not over():
                    self.got_room += 1
                    return True
                if give_up() or time.monotonic() > deadline:
                    break
                if passes == seen:
                    continue
                # The pass that ends at asked + 1 may have begun before we asked;
                # the next one began after, with our WANT in view.
                if passes >= asked + 2 and not removed:
                    break
                seen = passes
                self._enter(0)  # our ring's queue has changed meanwhile
                self.evict_wake.post()  # room went to other writes: another pass
            self._refuse_until = time.monotonic() + ROOM_WAIT_S
            return False
        finally:
            self._enter(-1)
            lane.paused_ns += int((time.monotonic() - t0) * 1e9)

    def _enter(self, step: int) -> None:
        """Count a lane in or out of the wait (0: refresh) and publish WANT: the
        bytes of the writes waiting here and of those queued behind them, less
        one: the worker's INFLIGHT reservation, which the evictor counts as
        held already (workers.inflight)."""
        with self._lock:
            self._waiting += step
            n = self._waiting - 1 + self.queued() if self._waiting else 0
            self.stats[WANT] = n * self.file_bytes
