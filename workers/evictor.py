"""The evictor: keeps a page store under its byte limit and above its free-space floor.

Runs as its own process (``python -m workers.evictor hicache_mp-evictor '<json>'``),
started by the engine when `storage_max_bytes` or `storage_min_free_bytes` is
set. A process, not a thread in the scheduler: a store of many pages takes
thousands of stat/unlink calls per pass, and a thread would both compete with
the scheduler's loop for the GIL and starve behind it (docs/design.md §1), falling
behind writes exactly when the disk fills. Torch-free, like the workers.

    engine                        evictor                           workers
    ------                        -------                           -------
    PINS[h(digest)] += 1  ──────► never unlinks a pinned page
    on submit, -= 1 on done       scan the store (workers.store):   a read stamps the page
                                  last access per page ◄─────────── (the LRU stamp)
    poll(): evict_ring.pop() ◄─── push (KIND_EVICT, digest, bytes)  reserve bytes before a
    index forgets the page        per page removed                  write; over a limit:
                                  sleeps on evict_sem ◄──────────── post evict_sem, WANT,
                                  frees sum(WANT) more too          wait for room (bounded)
                                  EVICT_REMOVED, EVICT_PASSES ────► ...or DROPPED

A pass (when a worker posts that a limit is near, and every `interval_s`):
  1. snapshot sum(WRITTEN) and the writes in flight (INFLIGHT and its key
     per worker), scan each part of the store (one per directory of a
     striped store; page files and temp files count towards the total; only
     page files are removed);
  2. count each of this engine's writes in flight once (below), publish
     STORE_BASE (scanned bytes + writes in flight), then WRITTEN_AT_SCAN
     (workers.control explains the order);
  3. per part (one per directory of a striped store), with its share of the
     limits (max_bytes / parts, the floor on its own filesystem): if it holds
     more than `share - headroom` or its free space is below `min_free +
     headroom`, take that directory's eviction lease (or skip: another
     engine's evictor holds it; workers.evictlease), measure again, and
     remove the least recently accessed unpinned pages (`eviction_order`:
     stamps from the future first) until it holds at most `share - 2 *
     headroom` and has `min_free + 2 * headroom` free (hysteresis: one pass
     frees room for several writes, not one), reporting each on the evict
     ring;
  4. writes waiting at a limit (workers.room) make a pass free their WANT
     (the bytes of the writes waiting behind the limit, the part's share of
     them) on top of that, and start one even inside the band: a burst of new
     pages larger than the band lands whole, the least recently used pages
     making room for it, rather than a band's worth landing and the rest
     dropped;
  5. store the pages removed (EVICT_REMOVED), then count the pass
     (EVICT_PASSES): a waiter that sees a pass begun after it asked end with
     nothing removed stops waiting.

Counting a write once (workers.inflight has the rule and why it never
under-counts): a write of this engine in flight when the pass starts is in
the INFLIGHT snapshot, and the scan may also meet its temp file, or, as a
scan of a big or remote store takes far longer than one write, the page it
has renamed into place since. Counted both ways, a pass would remove a page
more than needed per write in flight. So the write's own temp file (told by
this host's owner field, the worker's pid and the page's key in its name) is
left out, and its reservation is left out when the write had ended by the
end of the scan and the scan met its page. Other writers' temp files (other
engines, dead workers) always count: their bytes are in no INFLIGHT of ours.

Safety with several engines on one directory: page files are immutable
(writers rename a whole new file over the old name), so removing one never
tears anything: a reader that opened it keeps reading the same inode, and one
that opens after the unlink gets ENOENT, a clean miss. Pins are per engine:
another engine's evictor may remove a page this engine is about to read,
which costs that read a miss, never wrong bytes. A page can also be removed
between the pin check and the unlink if an op pins it in that window (a few
microseconds); that too is a clean miss, counted, and the index heals.

Must not read page contents, and must not remove anything that is not a page
file (temp files belong to writers, quarantined files to the operator).

Record fields on the evict ring: kind=KIND_EVICT, digest, io_ns = bytes freed.
"""
import json
import os
import sys
import time

import numpy as np

from shm import Ring, WakeSemaphore
from shm.ring import RECORD_DTYPE
from workers import evictlease, inflight
from workers.child import Child, ParentWatch, child_main, orphan_cleanup, wait_ready
from workers.records import KIND_EVICT
from workers.stores import open_store
from workers.timing import EVICT_REPORT_POLL_S, EVICT_REPORT_WAIT_S, FUTURE_SLACK_S, PARENT_CHECK_S, \
    STOP_GRACE_S
from workers.control import EVICT_PASSES, EVICT_REMOVED, EVICTOR_PID, MAX_BYTES, MIN_FREE, STOP, \
    STORE_BASE, WANT, WRITTEN, WRITTEN_AT_SCAN, Control, pin_slot

LEASE_CHECK_EVERY = 64  # removals between checks that the eviction lease is still ours
EVICT_RING_CAPACITY = 8192


def headroom_bytes(max_bytes: int, min_free: int, file_bytes: int) -> int:
    """Hysteresis band: 5 % of the larger limit, and at least four page files."""
    return max(4 * file_bytes, max(max_bytes, min_free) // 20)


class Evictor:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.store = open_store(cfg["storage_dir"])
        self.parent = ParentWatch(cfg["parent_pid"])
        self.interval_s = cfg["interval_s"]
        self.headroom = cfg["headroom"]
        self.control = Control(cfg["control"], create=False)
        self.ring = Ring(cfg["evict_ring"], cfg["evict_ring_capacity"], create=False)
        self.wake = WakeSemaphore(cfg["evict_sem"], create=False)
        self.out = np.zeros(1, dtype=RECORD_DTYPE)
        self.out["kind"] = KIND_EVICT
        self.out["host_page"] = -1

    def run(self) -> int:
        self.control.words[EVICTOR_PID] = os.getpid()
        orphaned = False
        # Started with its engine, the first pass waits for the engine's post
        # (its workers are ready) or interval_s: a pass walks the whole store,
        # and beside the workers' start on a small machine it would make the
        # engine's start grow with the store (decision 110).
        hold = self.cfg.get("hold_first_pass", False)
        while not self.control.stopping():
            if self.parent.gone():
                orphaned = True
                break
            if hold:
                hold = False
            else:
                self.one_pass()
            deadline = time.monotonic() + self.interval_s
            while not self.control.stopping() and not self.parent.gone():
                left = deadline - time.monotonic()
                if left <= 0 or self.wake.wait(min(left, PARENT_CHECK_S)):
                    break
            self.wake.drain()  # a burst of posts from workers costs one pass
        if orphaned:
            orphan_cleanup(self.cfg["orphan_unlink_shm"], self.cfg["orphan_unlink_sem"])
        return 0

    # --- one pass -----------------------------------------------------------
    def one_pass(self) -> int:
        parts = self.store.parts()
        scans, used = self._measure(parts)
        removed = 0
        for i, part in enumerate(parts):
            if self._need(part, used[i], len(parts)) <= 0:
                continue
            # The store may be shared: one evictor at a time per directory, on a
            # fresh measure (workers.evictlease). Without the lease another one is at it.
            lease = evictlease.take(part.root)
            if lease is None:
                continue
            try:
                scans, used = self._measure(parts)
                removed += self._evict(part, scans[i].pages, self._need(part, used[i], len(parts)),
                                       lease)
            finally:
                lease.release()
        # After the scan's STORE_BASE and the removals: a waiter that sees the
        # count move sees what this pass left (workers.room).
        self.control.words[EVICT_REMOVED] = removed
        self.control.words[EVICT_PASSES] += 1
        return removed

    def _measure(self, parts: list) -> tuple[list, list]:
        """Scan every part (every node's files) and publish the store's size to
        the workers; ([Scan] per part, bytes each part holds with this engine's
        writes in flight, each counted once)."""
        words = self.control.words
        # WRITTEN first, then the writes in flight: a write reserved between the
        # two loads is then counted twice (safe), never missed. A write in flight
        # now may not be on disk when the scan passes its directory: its
        # reservation covers it (workers.inflight: and is counted once).
        written_before = int(self.control.workers[:, WRITTEN].sum())
        writes = inflight.before(self.control)
        scans = [part.scan() for part in parts]
        held, reserved, in_flight = inflight.count_once(self.control, scans, writes)
        # Anything written while we scanned may be counted twice: an over-estimate.
        words[STORE_BASE] = sum(held) + in_flight
        words[WRITTEN_AT_SCAN] = written_before
        return scans, [h + r for h, r in zip(held, reserved)]

    def _need(self, part, used: int, nparts: int) -> int:
        """Bytes to remove from one part (holding `used`) so it is back inside
        its share of the limits, with hysteresis, and has room for its share of
        the writes waiting at a limit (WANT)."""
        words = self.control.words
        max_bytes, min_free = int(words[MAX_BYTES]), int(words[MIN_FREE])
        share, headroom = max_bytes // nparts, max(self.headroom // nparts, 1)
        want = int(self.control.workers[:, WANT].sum()) // nparts
        need = 0
        if max_bytes and used + want > share - headroom:
            need = used + want - (share - 2 * headroom)
        free = part.free_bytes()
        if min_free and free is not None and free - want < min_free + headroom:
            need = max(need, min_free + 2 * headroom + want - free)
        return need

    def _evict(self, part, pages: list, need: int, lease) -> int:
        """Remove the coldest unpinned pages of one part until `need` bytes are freed."""
        if need <= 0:
            return 0
        words, pins = self.control.words, self.control.pins
        freed = removed = 0
        for page in eviction_order(pages, time.time_ns()):
            if freed >= need or self.control.stopping():
                break
            if pins[pin_slot(page.digest)]:
                continue  # in flight in this engine: never evicted
            if not self._room_to_report():
                break  # the engine is not polling; evict more once it has caught up
            if removed % LEASE_CHECK_EVERY == LEASE_CHECK_EVERY - 1 and not lease.held():
                break  # our lease expired and another evictor took over
            if not part.remove(page.digest):
                continue
            freed += page.size
            removed += 1
            words[STORE_BASE] = max(0, int(words[STORE_BASE]) - page.size)
            self.out["digest"][0] = np.frombuffer(page.digest, dtype=np.uint8)
            self.out["io_ns"][0] = page.size
            self.ring.push(self.out)
        return removed

    def _room_to_report(self) -> bool:
        """Every removal is reported (the index must forget it): wait briefly for room."""
        deadline = time.monotonic() + EVICT_REPORT_WAIT_S
        while self.ring.free() == 0:
            if time.monotonic() > deadline or self.control.stopping():
                return False
            time.sleep(EVICT_REPORT_POLL_S)
        return True


# FUTURE_SLACK_S: a stamp further ahead of this clock than that is not a last
# access: the clock went back, or the file came with a time from elsewhere.


def eviction_order(pages: list, now_ns: int) -> list:
    """Pages coldest first, by last access, trusting no stamp from the future.

    A page stamped more than FUTURE_SLACK_S ahead of now has not been read
    since the clock went back (a read stamps it with now), so it goes first,
    before every page read or written since; such pages keep their order
    among themselves. Trusting those stamps would evict the pages used just
    now before cold ones.
    """
    limit = now_ns + int(FUTURE_SLACK_S * 1e9)
    return sorted(pages, key=lambda p: (p.stamp_ns <= limit, p.stamp_ns))


# --- the engine's side: start, watch, stop ---------------------------------------
class EvictorProcess:
    """The engine's handle on its evictor: the ring, the semaphore and the process.

    Shutdown: the engine sets STOP (WorkerPool.stop), then `close()` posts the
    semaphore, waits up to `grace_s`, kills a straggler, and unlinks the ring
    and the semaphore.
    """

    def __init__(self, *, tag: str, control: Control, storage_dir: str, interval_s: float,
                 headroom: int):
        self.control = control
        self.ring = Ring(tag + ".evict", EVICT_RING_CAPACITY, create=True)
        try:
            self.wake = WakeSemaphore(tag + ".evictwake", create=True)
        except BaseException:
            self.ring.close()
            raise
        self.cfg = {"storage_dir": storage_dir, "parent_pid": os.getpid(), "interval_s": interval_s,
                    "headroom": headroom, "control": control.name, "evict_ring": self.ring.name,
                    "evict_ring_capacity": EVICT_RING_CAPACITY, "evict_sem": self.wake.name,
                    "orphan_unlink_shm": [self.ring.name, control.name],
                    "orphan_unlink_sem": [self.wake.name]}
        self.child = None
        self.timeout_s = 60.0
        self.respawns = 0
        self.evicted_pages = 0
        self.evicted_bytes = 0

    def start(self, timeout_s: float = 60.0, *, wait: bool = True,
              hold_first_pass: bool = False) -> None:
        """Launch the evictor; with `wait`, until it says ready (else see
        `check_start`). `hold_first_pass`: its first pass waits for a post of
        `wake` (or interval_s)."""
        self.control.words[EVICTOR_PID] = 0
        cfg = dict(self.cfg, hold_first_pass=hold_first_pass)
        self.child = Child("workers.evictor", "hicache_mp-evictor", json.dumps(cfg),
                           ready_word=lambda: self.control.words[EVICTOR_PID])
        self.timeout_s = timeout_s
        if wait:
            wait_ready([self.child], timeout_s)

    def check_start(self) -> bool:
        """Non-blocking: is a launched evictor ready? ChildStartError if it failed."""
        return self.child.check_start(self.timeout_s)

    @property
    def proc(self):
        return None if self.child is None else self.child.proc

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def pop(self) -> np.ndarray:
        recs = self.ring.pop()
        if len(recs):
            self.evicted_pages += len(recs)
            self.evicted_bytes += int(recs["io_ns"].sum())
        return recs

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        if self.child is not None:
            self.control.words[STOP] = 1
            try:
                self.wake.post()
            except Exception:
                pass
            self.child.stop(time.monotonic() + grace_s)
            self.child = None
        self.ring.close()
        self.wake.close()


def main(argv: list[str]) -> int:
    return child_main(argv, json.loads, lambda cfg: Evictor(cfg).run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
