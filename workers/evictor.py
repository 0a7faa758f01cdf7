"""The evictor: keeps a page store under its byte limit and above its free-space floor.

Runs as its own process (``python -m workers.evictor hicache_mp-evictor '<json>'``),
started by the engine when `storage_max_bytes` or `storage_min_free_bytes` is
set. A process, not a thread in the scheduler: a store of many pages takes
thousands of stat/unlink calls per pass, and a thread would both compete with
the scheduler's loop for the GIL and starve behind it (DESIGN.md §1), falling
behind writes exactly when the disk fills. Torch-free, like the workers.

    engine                        evictor                           workers
    ------                        -------                           -------
    PINS[h(digest)] += 1  ──────► never unlinks a pinned page
    on submit, -= 1 on done       scan: stat every page file        futimens after a read
                                  (mtime = last access) ◄────────── (the LRU stamp)
    poll(): evict_ring.pop() ◄─── push (KIND_EVICT, digest, bytes)  reserve bytes before a
    index forgets the page        per page removed                  write; over a limit:
                                  sleeps on evict_sem ◄──────────── DROPPED, post evict_sem

A pass (when a worker posts that a limit is near, and every `interval_s`):
  1. snapshot sum(WRITTEN) and sum(INFLIGHT), scan the fan-out directories
     (page files and temp files count towards the total; only page files are
     removed);
  2. publish STORE_BASE (scanned bytes + INFLIGHT), then WRITTEN_AT_SCAN
     (workers.control explains the order);
  3. if the total is above `max_bytes - headroom` or free space below
     `min_free + headroom`: take the store's eviction lease (or skip: another
     engine's evictor holds it; workers.evictlease), scan again, and unlink
     the least recently accessed unpinned pages until the total is at most `max_bytes - 2 * headroom` and free space at
     least `min_free + 2 * headroom` (hysteresis: one pass frees room for
     several writes, not one), reporting each on the evict ring.

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
from workers import evictlease, naming
from workers.child import PARENT_CHECK_S, Child, ParentWatch, child_main, orphan_cleanup, \
    wait_ready
from workers.records import KIND_EVICT
from workers.storedir import fanout_dirs
from workers.control import EVICTOR_PID, INFLIGHT, MAX_BYTES, MIN_FREE, STOP, STORE_BASE, WRITTEN, \
    WRITTEN_AT_SCAN, Control, pin_slot

LEASE_CHECK_EVERY = 64  # removals between checks that the eviction lease is still ours
EVICT_RING_CAPACITY = 8192


def headroom_bytes(max_bytes: int, min_free: int, file_bytes: int) -> int:
    """Hysteresis band: 5 % of the larger limit, and at least four page files."""
    return max(4 * file_bytes, max(max_bytes, min_free) // 20)


class Evictor:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.root = cfg["storage_dir"]
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
        while not self.control.stopping():
            if self.parent.gone():
                orphaned = True
                break
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
        pages, total = self._measure()
        if self._need(total) <= 0:
            return 0
        # The store may be shared: one evictor at a time, on a fresh measure
        # (workers.evictlease). Without the lease another one is at it.
        lease = evictlease.take(self.root)
        if lease is None:
            return 0
        try:
            pages, total = self._measure()
            return self._evict(pages, self._need(total), lease)
        finally:
            lease.release()

    def _measure(self) -> tuple[list, int]:
        """Scan the store (every node's files) and publish its size to the workers."""
        words = self.control.words
        # WRITTEN first, then INFLIGHT: a write reserved between the two loads is
        # then counted twice (safe), never missed. A write in flight now may not
        # be on disk when the scan passes its directory: INFLIGHT covers it.
        written_before = int(self.control.workers[:, WRITTEN].sum())
        in_flight = int(self.control.workers[:, INFLIGHT].sum())
        pages, total = scan(self.root)
        total += in_flight
        # Anything written while we scanned may be counted twice: an over-estimate.
        words[STORE_BASE] = total
        words[WRITTEN_AT_SCAN] = written_before
        return pages, total

    def _need(self, total: int) -> int:
        """Bytes to remove so the store is back inside its limits, with hysteresis."""
        words = self.control.words
        max_bytes, min_free = int(words[MAX_BYTES]), int(words[MIN_FREE])
        need = 0
        if max_bytes and total > max_bytes - self.headroom:
            need = total - (max_bytes - 2 * self.headroom)
        free = _free_bytes(self.root)
        if min_free and free is not None and free < min_free + self.headroom:
            need = max(need, min_free + 2 * self.headroom - free)
        return need

    def _evict(self, pages: list, need: int, lease) -> int:
        if need <= 0:
            return 0
        words = self.control.words
        pages.sort()  # oldest access first
        pins = self.control.pins
        freed = removed = 0
        for _mtime, size, path, digest in pages:
            if freed >= need or self.control.stopping():
                break
            if pins[pin_slot(digest)]:
                continue  # in flight in this engine: never evicted
            if not self._room_to_report():
                break  # the engine is not polling; evict more once it has caught up
            if removed % LEASE_CHECK_EVERY == LEASE_CHECK_EVERY - 1 and not lease.held():
                break  # our lease expired and another evictor took over
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # another engine removed or replaced it: the space is gone anyway
            except OSError:
                continue
            freed += size
            removed += 1
            words[STORE_BASE] = max(0, int(words[STORE_BASE]) - size)
            self.out["digest"][0] = np.frombuffer(digest, dtype=np.uint8)
            self.out["io_ns"][0] = size
            self.ring.push(self.out)
        return removed

    def _room_to_report(self) -> bool:
        """Every removal is reported (the index must forget it): wait briefly for room."""
        deadline = time.monotonic() + 1.0
        while self.ring.free() == 0:
            if time.monotonic() > deadline or self.control.stopping():
                return False
            time.sleep(0.005)
        return True


def scan(root: str) -> tuple[list, int]:
    """([(mtime_ns, bytes, path, digest)] of page files, bytes of pages and temp files)."""
    pages, total = [], 0
    for sub in fanout_dirs(root):
        try:
            it = os.scandir(sub)
        except OSError:
            continue
        with it:
            for entry in it:
                digest = naming.digest_from_name(entry.name)
                if digest is None and naming.TMP_MARK not in entry.name:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed under us
                total += st.st_size
                if digest is not None:
                    pages.append((st.st_mtime_ns, st.st_size, entry.path, digest))
    return pages, total


def _free_bytes(path: str) -> int | None:
    try:
        vfs = os.statvfs(path)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


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

    def start(self, timeout_s: float = 60.0, *, wait: bool = True) -> None:
        """Launch the evictor; with `wait`, until it says ready (else see `check_start`)."""
        self.control.words[EVICTOR_PID] = 0
        self.child = Child("workers.evictor", "hicache_mp-evictor", json.dumps(self.cfg),
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

    def close(self, grace_s: float = 2.0) -> None:
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
