"""The I/O worker process: pops page records, moves bytes between files and the pool.

Run as ``python -m workers.worker hicache_mp-worker-<i> '<WorkerSpec json>'`` by
`WorkerPool`, through workers.child (a fresh interpreter: no CUDA state, no
inherited locks). Everything it is told is a `WorkerSpec` (workers.spec).
Imports no torch: os, mmap, numpy and posix_ipc only.

Owns the per-page I/O: a read is open + one preadv (header and payload
straight into the pool slot) + close; a write is a pwritev into a private temp
file + os.replace. With `direct_io` both open the file O_DIRECT (the engine
decided it is safe: workers.directio). Must not decide policy: it does what
the records say and reports a status for each.

Two submit rings per worker: `read_ring` (prefetch) and `write_ring`
(backup). Reads come first: a prefetch is on a request's critical path, a
backup is not. Writes are taken one at a time, and the read ring is looked at
(one load) before each, so a read that arrives behind a burst of backups
waits for at most one page write. Reads come first across the engine too: a
worker with no read of its own defers a write while any worker still has
reads outstanding (workers.control), because on one device every byte
written is bandwidth a read does not get (figures: docs/decisions.md 20).
Writes are never starved: after `reads_per_write` reads in a row with writes
waiting, one write goes, and a write deferred for WRITE_DEFER_MAX_S goes
whatever the reads elsewhere.

Loop, with one exit path:
  1. pop up to `batch` records from the read ring; do each (after every
     `reads_per_write` of them, one queued write if any);
  2. else, if it is a write's turn (`write_turn`), pop one record from the
     write ring and do it;
  3. if neither had work: sleep on the wake semaphore (timeout: parent
     watch; DEFER_POLL_S while a write is deferred), go to 1;
  4. each record: skip if its op is cancelled, else do the I/O, push a
     completion (status, io time), post the done semaphore if anyone waits;
  5. leave when the control block says stop or the parent has gone. An
     orphan unlinks the names it knows, so a crashed scheduler leaves nothing
     in /dev/shm even if no engine ever starts again.

With `io_depth` > 1 (`--hicache-mp-io-depth`) the same choices are made by a
dispatcher, one record at a time, and `io_depth` threads of this process do
the I/O (preadv/pwritev release the GIL), so one worker keeps that many
page I/Os in flight; see workers.lanes for when that pays.

Capacity (when the engine sets storage limits): before a write the worker
reserves the file's bytes in its WRITTEN counter and checks the store
estimate (workers.control) and, with a free-space floor, statvfs; a write
that would cross a limit is not attempted: status DROPPED (errno ENOSPC), and
the evictor is woken. After a successful read the worker stamps the file's
times (futimens), at most once per `TOUCH_INTERVAL_S` per page: that is the
"last access" the evictor's LRU orders by, recorded here so that the
scheduler makes no syscall for it.
"""
import errno
import itertools
import os
import stat
import sys
import threading
import time

import numpy as np

from shm import PageGeometry, Ring, WakeSemaphore
from shm.hostpool import HostPool
from workers import directio, naming, pagefile, status
from workers.fileio import preadv_full, pwritev_full
from workers.child import PARENT_CHECK_S, ParentWatch, child_main, orphan_cleanup
from workers.lanes import DEFER_POLL_S, Lane, run_lanes
from workers.records import KIND_PROBE, KIND_READ
from workers.spec import WorkerSpec
from workers.storedir import DIR_MODE, ensure_parent
from workers.control import BUSY_NS, BYTES, INFLIGHT, MAX_BYTES, MIN_FREE, PAGES, READS_DONE, \
    READY_PID, WAITERS, WRITTEN, Control

# A write deferred for reads at other workers goes after this long anyway: the
# backstop against starving backups (their host pages stay pinned meanwhile).
WRITE_DEFER_MAX_S = 0.5
# A page's access stamp is refreshed at most this often per worker: LRU needs
# order at a coarse grain, not a metadata write per read.
TOUCH_INTERVAL_S = 1.0
_TOUCH_MEMORY = 1 << 16  # digests remembered for that rate limit, then forgotten

# Damage that proves the file is not a usable page for anyone under this name.
# UNREADABLE is left alone: a permission problem or a directory is an
# operator's business, not proof of a bad page.
_MOVE_ASIDE = (status.CORRUPT, status.FOREIGN, status.WRONG_KEY)

# A read that finds its file gone after the open: another node removed or
# replaced it (eviction, a newer version renamed over it). JuiceFS answers the
# read with ENOENT or EBADF once the inode is deleted, NFS with ESTALE. The key
# simply has no page right now: a miss, not an unreadable store.
_GONE = (errno.ENOENT, errno.ESTALE, errno.EBADF)

_WRITE_ERRNO = {
    errno.ENOSPC: status.NOSPACE, errno.EDQUOT: status.NOSPACE, errno.EFBIG: status.NOSPACE,
    errno.EACCES: status.DENIED, errno.EPERM: status.DENIED, errno.EROFS: status.DENIED,
}


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.index = spec.index
        self.parent = ParentWatch(spec.parent_pid)
        self.root = spec.storage_dir
        self.geometry = PageGeometry.from_dict(spec.geometry)
        self.fp = self.geometry.fingerprint()
        self.payload_len = self.geometry.page_bytes
        self.verify_crc = spec.verify_checksum
        self.write_crc = spec.write_checksum
        self.fsync = spec.fsync
        self.quarantine = spec.quarantine_bad_files
        self.batch = spec.worker_batch
        # pool_fd: the pool is a region the engine did not create (SGLang's memfd host
        # pool, hicache_mp.integrations.sglang), inherited through Popen(pass_fds=...).
        self.pool = HostPool(self.geometry, spec.pool_pages, name=spec.pool_name,
                             create=False, populate=spec.populate, fd=spec.pool_fd)
        self.read_ring = Ring(spec.read_ring, spec.ring_capacity, create=False)
        self.write_ring = Ring(spec.write_ring, spec.ring_capacity, create=False)
        self.completion = Ring(spec.completion_ring, spec.completion_capacity, create=False)
        self.reads_per_write = spec.reads_per_write
        self.wake = WakeSemaphore(spec.wake_sem, create=False)
        self.done = WakeSemaphore(spec.done_sem, create=False)
        self.control = Control(spec.control, create=False)
        self.stats = self.control.workers[self.index]
        self.heartbeat = self.control.heartbeat[self.index]
        self.direct = spec.direct_io
        self.depth = spec.io_depth
        self.lane = Lane(self.direct, 0)  # the loop's own; run_lanes makes one per thread
        self.open_flags = directio.O_DIRECT if self.direct else 0
        self.file_bytes = pagefile.HEADER_SIZE + self.payload_len
        self.capped = spec.capacity
        self.evict_wake = WakeSemaphore(spec.evict_sem, create=False) if spec.evict_sem else None
        self.headroom = spec.evict_headroom
        self.num_workers = spec.num_workers
        self.touched: dict[bytes, float] = {}
        self.read_streak = 0  # reads done in a row while writes waited
        self.deferred_since = None  # monotonic time a waiting write was first deferred
        self.made_dirs: set[str] = set()
        self.serials = itertools.count(1)  # temp and quarantine names; thread-safe under the GIL
        self.pid = os.getpid()
        # One producer at a time on the completion ring (SPSC), and the stats
        # words are read-modify-write: lane threads take this for both.
        self.push_lock = threading.Lock()

    # --- the loop -----------------------------------------------------------
    def run(self) -> int:
        self.stats[READY_PID] = self.pid
        orphaned = run_lanes(self) if self.depth > 1 else self._run_inline()
        if orphaned:
            self._unlink_all()
        return 0

    def parent_gone(self) -> bool:
        return self.parent.gone()

    def _run_inline(self) -> bool:
        """The loop of the module docstring, one I/O at a time; True if orphaned."""
        while not self.control.stopping():
            if self.parent_gone():
                return True
            records = self.read_ring.pop(self.batch)
            if len(records):
                for rec in records:
                    self.serve(rec, self.lane)
                    self.read_streak += 1
                    if self.read_streak >= self.reads_per_write and self.write_ring.pending():
                        self._one_write()  # reads first, but writes are never starved
                continue
            self.read_streak = 0
            if self.write_ring.pending():
                if self.write_turn():
                    self._one_write()
                else:
                    self.wake.wait(DEFER_POLL_S)
                continue
            self.wake.wait(PARENT_CHECK_S)
        return False

    def write_turn(self) -> bool:
        """With no read of its own waiting: may a queued write go now?

        Not while reads are outstanding at any worker (module docstring),
        unless this write has been deferred for WRITE_DEFER_MAX_S.
        """
        if not self.control.reads_outstanding(self.num_workers):
            self.deferred_since = None
            return True
        now = time.monotonic()
        if self.deferred_since is None:
            self.deferred_since = now
        if now - self.deferred_since >= WRITE_DEFER_MAX_S:
            self.deferred_since = None
            return True
        return False

    def _one_write(self) -> None:
        self.read_streak = 0
        self.deferred_since = None
        recs = self.write_ring.pop(1)
        if len(recs):
            self.serve(recs[0], self.lane)

    def serve(self, rec, lane: Lane) -> None:
        t0 = time.perf_counter_ns()
        self.heartbeat[lane.slot] = time.monotonic_ns()  # the engine's watchdog looks at it
        if rec["kind"] == KIND_PROBE:  # belongs to no op: never "cancelled"
            code, err, nbytes = self._probe(rec["digest"].tobytes()), 0, 0
        elif self.control.cancelled(int(rec["op_id"])):
            code, err, nbytes = status.CANCELLED, 0, 0
        else:
            digest = rec["digest"].tobytes()
            path = naming.page_path(self.root, digest)
            iovecs = self.pool.page_iovecs(int(rec["host_page"]))
            if rec["kind"] == KIND_READ:
                code, err = self._read(path, digest, iovecs, lane)
            else:
                code, err = self._write(path, digest, iovecs, lane)
            nbytes = self.payload_len if code == status.OK else 0
        io_ns = time.perf_counter_ns() - t0
        self.heartbeat[lane.slot] = 0
        out = lane.out
        out[0] = rec
        out["status"][0] = code
        out["flags"][0] = err
        out["io_ns"][0] = io_ns
        with self.push_lock:
            # Counted before the completion is pushed, so metrics() never shows
            # fewer pages than the engine has already seen complete. With lanes
            # BUSY_NS sums every lane's I/O time: busy fraction can pass 1.
            self.stats[BUSY_NS] += io_ns
            self.stats[PAGES] += rec["kind"] != KIND_PROBE
            self.stats[BYTES] += nbytes
            if rec["kind"] == KIND_READ:
                self.stats[READS_DONE] += 1
            while self.completion.push(out) == 0:
                # The scheduler has not drained completions yet; it will. Never drop one.
                if self.parent_gone() or self.control.stopping():
                    return
                time.sleep(0.0005)
        if self.control.words[WAITERS]:
            self.done.post()

    # --- probes -------------------------------------------------------------
    def _probe(self, digest: bytes) -> int:
        """Is this key's page on disk? One stat; OK for a regular file of a
        page's size (a read still checks it). Answers the engine's discovery
        of pages other engines wrote (hicache_mp.discovery)."""
        try:
            st_ = os.stat(naming.page_path(self.root, digest), follow_symlinks=False)
        except OSError:
            return status.MISS
        whole = stat.S_ISREG(st_.st_mode) and st_.st_size == self.file_bytes
        return status.OK if whole else status.MISS

    # --- reads --------------------------------------------------------------
    def _read(self, path: str, digest: bytes, iovecs, lane: Lane) -> tuple[int, int]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | self.open_flags)
        except FileNotFoundError:
            return status.MISS, 0
        except OSError as exc:
            return (status.MISS if exc.errno == errno.ESTALE else status.UNREADABLE), exc.errno or 0
        try:
            want = self.file_bytes
            try:
                got = preadv_full(fd, [lane.header, *iovecs, lane.overflow],
                                  want + len(lane.overflow), self.direct)
            except OSError as exc:
                return (status.MISS if exc.errno in _GONE else status.UNREADABLE), exc.errno or 0
            code = self._check(got, want, digest, iovecs, lane.header)
            if code in _MOVE_ASIDE and self.quarantine:
                self._move_aside(path, fd, code)  # while fd still names the file we judged
            elif code == status.OK:
                self._touch(fd, digest)
            return code, 0
        finally:
            os.close(fd)

    def _check(self, got: int, want: int, digest: bytes, iovecs, header) -> int:
        if got < pagefile.HEADER_SIZE:
            return status.CORRUPT
        code, crc = pagefile.check_header(header, self.payload_len, self.fp, digest)
        if code != status.OK:
            return code
        if got != want:  # truncated or longer than a page: never trust it
            return status.CORRUPT
        if crc is not None and self.verify_crc and pagefile.payload_crc(iovecs) != crc:
            return status.CORRUPT
        return status.OK

    def _touch(self, fd: int, digest: bytes) -> None:
        """Stamp the file's times with now: its last access, for the evictor's LRU."""
        now = time.monotonic()
        last = self.touched.get(digest)
        if last is not None and now - last < TOUCH_INTERVAL_S:
            return
        if len(self.touched) >= _TOUCH_MEMORY:
            self.touched.clear()
        self.touched[digest] = now
        try:
            os.utime(fd)  # futimens(fd, NULL): the inode we read, even if renamed over since
        except OSError:
            pass  # read-only store or another owner: LRU falls back to write time

    def _move_aside(self, path: str, fd: int, code: int) -> None:
        """Best effort: rename a damaged page file into the quarantine directory.

        Only if `path` still names the file that was read: another engine may
        have replaced it with a good page since (a narrow race remains; losing
        it costs one later miss, never wrong bytes).
        """
        try:
            seen, now = os.fstat(fd), os.stat(path)
            if (seen.st_dev, seen.st_ino) != (now.st_dev, now.st_ino):
                return
            qdir = os.path.join(self.root, naming.QUARANTINE_DIR)
            if qdir not in self.made_dirs:
                os.makedirs(qdir, mode=DIR_MODE, exist_ok=True)
                self.made_dirs.add(qdir)
            os.rename(path, naming.quarantine_path(self.root, path, status.NAMES[code],
                                                   self.pid, next(self.serials)))
        except OSError:
            pass  # the read is a miss either way

    # --- writes -------------------------------------------------------------
    def _write(self, path: str, digest: bytes, iovecs, lane: Lane) -> tuple[int, int]:
        if self.capped:
            refused = self._reserve()
            if refused:
                return refused
        crc = pagefile.payload_crc(iovecs) if self.write_crc else None
        lane.write_header[:] = pagefile.build_header(self.payload_len, self.fp, digest, crc)
        tmp = naming.tmp_path(path, self.pid, next(self.serials))
        fd = -1
        try:
            directory = os.path.dirname(path)
            if directory not in self.made_dirs:
                ensure_parent(path, self.root)
                self.made_dirs.add(directory)
            # With O_DIRECT every run is a whole number of 4096-byte blocks
            # (directio.geometry_aligned), so the file length is too: no
            # ftruncate fix-up is needed after the aligned write.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | self.open_flags,
                         0o600)
            pwritev_full(fd, [lane.write_header, *iovecs], self.direct)
            if self.fsync == "data":
                os.fdatasync(fd)
            elif self.fsync == "always":
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)  # readers see the old page or the new one, never a part
            if self.capped:
                self.stats[INFLIGHT] = 0  # a scan from now on sees the file itself
            return status.OK, 0
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if self.capped:
                self.stats[WRITTEN] -= np.uint64(self.file_bytes)  # give the reservation back
                self.stats[INFLIGHT] = 0
            return _WRITE_ERRNO.get(exc.errno, status.IOERROR), exc.errno or 0

    def _reserve(self) -> tuple[int, int] | None:
        """Claim this write's bytes against the store's limits; a refusal status or None.

        The reservation is made before the check, so two workers racing for the
        last bytes both see each other's claim (both may refuse: the safe side).
        """
        words, nbytes = self.control.words, self.file_bytes
        self.stats[INFLIGHT] = nbytes  # before WRITTEN: see Evictor.one_pass
        self.stats[WRITTEN] += np.uint64(nbytes)
        est = self.control.store_estimate()
        max_bytes, min_free = int(words[MAX_BYTES]), int(words[MIN_FREE])
        over = bool(max_bytes) and est > max_bytes
        near = bool(max_bytes) and est > max_bytes - self.headroom
        if min_free and not over:
            try:
                vfs = os.statvfs(self.root)
                free = vfs.f_bavail * vfs.f_frsize
                # statvfs cannot see the other workers' writes in progress: assume
                # each has one page under way (a margin of a page per worker).
                claim = nbytes * self.num_workers
                over = free - claim < min_free
                near = near or free - claim < min_free + self.headroom
            except OSError:
                pass
        if near and self.evict_wake is not None:
            self.evict_wake.post()
        if over:
            self.stats[WRITTEN] -= np.uint64(nbytes)
            self.stats[INFLIGHT] = 0
            return status.DROPPED, errno.ENOSPC
        return None

    def _unlink_all(self) -> None:
        orphan_cleanup(self.spec.orphan_shm, self.spec.orphan_sem)


def main(argv: list[str]) -> int:
    return child_main(argv, WorkerSpec.from_json, lambda spec: Worker(spec).run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
