"""FileStore: pages as files in one directory tree.

Owns every detail of a page on a POSIX filesystem: the fan-out tree
(workers.naming), the page-file format (workers.pagefile), whole-file
preadv/pwritev (workers.fileio), O_DIRECT, temp file + rename, the LRU stamp,
moving damaged files aside, the scan and free space. Must not know about
rings, ops or the pool: bytes go between iovecs and a file, and a status
comes back.

A read is: open the page file in its leaf directory (kept open, see below),
one preadv (header and payload straight into the pool slot's iovecs, plus an
overflow guard), check, close. A write is a pwritev into a private temp file
(workers.tmpfiles) and os.replace over the final name, so readers see the
old page or the new one, never a part. Buffered, and when the caller's
`bufs` carries a `gate`, the pwritev goes in pieces (workers.fileio.pieces)
with `gate()` called between two: the worker may pause a write there while
reads wait. O_DIRECT writes stay one pwritev (they wait on the device, not
on a core, and aligned pieces would only shrink the device's requests).

Nothing is ever reached through a symlink below the root: each fan-out level
and the file itself are opened relative to the directory above with
O_NOFOLLOW (O_DIRECTORY for the levels). A page file that is a symlink reads
as UNREADABLE (ELOOP) with no byte of the target copied; a fan-out directory
that is a symlink fails the I/O, so nothing is written outside the store.
The root itself may be a symlink: the operator chose it.

A page file is opened O_NONBLOCK and must be a regular file (fstat): a FIFO
at a page's path would otherwise hold the open until the stall watchdog kills
the worker, and a device node would be read as a page. Anything else reads
as UNREADABLE, left in place, and the next write renames a page over it.

Who may read what a store holds (decision 100): in a setgid directory, a
directory or page file made here copies the directory's group permission
bits (a page file the read and write bits, not execute); anywhere else it is
owner-only, and others never get a bit. A setgid directory is how an
operator says "files here belong to this group" (`chgrp kv store; chmod 2770
store`, or Kubernetes' fsGroup); the kernel gives new entries its group, and
new directories its setgid bit, so the whole tree follows. Every engine whose
uid is in that group then reads, writes and evicts the others' pages. A root
the engine made (0700), or made by a plain mkdir (0755), stays owner-only
below, as before. The modes are set whatever the umask (fchmod where it took
bits away).

Fan-out directories are opened (and made, for a write) on every write and
lookup: after `rm -rf store/*`, or the store directory removed and made
again, the next write makes its directories anew. A read remembers the leaf
directories it found (`_LEAVES` of them, by fan-out prefix, the oldest
dropped first) and opens its page with one openat there: the directory walk
was three opens and two closes, a third of what a layer group's read
(decision 101) costs beside its copy; decision 113. A read whose open
fails in a remembered leaf walks again, and that walk's answer stands: the
directory may have been removed and made again, or its network mount
remounted (old descriptors then answer ENOTCONN). A store moved elsewhere
whole is read where it went until then, and its pages are the same pages.

The LRU stamp: after a good read the file's times are set to now
(futimens on the open descriptor), at most once per TOUCH_INTERVAL_S per
page and process: order at a coarse grain, not a metadata write per read.
"""
import contextlib
import errno
import itertools
import os
import stat
import time

from workers import directio, fileio, naming, pagefile, status, tmpfiles
from workers.fileio import clear_direct, pieces, preadv_full, pwritev_full
from workers.store import DIR_MODE, Page, PageStore, Scan, StoreIO, free_bytes
from workers.timing import TOUCH_INTERVAL_S

_TOUCH_MEMORY = 1 << 16  # digests remembered for that rate limit, then forgotten
# Leaf directories a reader keeps open: a batch's pages spread over about as
# many leaves as pages (65,536 of them), so this covers a worker's share of a
# large batch, and stays well inside the default 1,024 open files.
_LEAVES = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_SUB_FLAGS = _DIR_FLAGS | os.O_NOFOLLOW
# O_NONBLOCK: an open of a FIFO returns at once instead of waiting for a
# writer. For a regular file it changes nothing: the kernel takes no-wait I/O
# from RWF_NOWAIT, never from O_NONBLOCK, for page-cache and O_DIRECT reads alike.
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK

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


class FileStore(PageStore):
    def __init__(self, root: str, io: StoreIO | None = None):
        self.root = root
        self.roots = [root]
        self.io = io or StoreIO()
        self.open_flags = directio.O_DIRECT if self.io.direct else 0
        self.file_bytes = pagefile.HEADER_SIZE + self.io.payload_len
        self.touched: dict[bytes, float] = {}
        self.leaves: dict[str, int] | None = None  # fan-out prefix -> open leaf (remember_leaves)
        self.serials = itertools.count(1)  # temp and quarantine names; thread-safe under the GIL

    # --- directories ----------------------------------------------------------
    def _leaf(self, h: str, create: bool) -> int:
        """A descriptor of the page's fan-out directory (made if `create`)."""
        top = os.open(self.root, _DIR_FLAGS)
        try:
            mid = _subdir(top, h[:2], create)
            try:
                return _subdir(mid, h[2:4], create)
            finally:
                os.close(mid)
        finally:
            os.close(top)

    @contextlib.contextmanager
    def _page_at(self, digest: bytes):
        """(descriptor of the page's fan-out directory, the page file's name in
        it), the descriptor closed at the end; OSError where the directory
        cannot be opened (FileNotFoundError: there is none, so no such page)."""
        h = digest.hex()
        leaf = self._leaf(h, create=False)
        try:
            yield leaf, h + naming.PAGE_SUFFIX
        finally:
            os.close(leaf)

    # --- reads ------------------------------------------------------------------
    def remember_leaves(self) -> None:
        """Keep the leaf directories reads find open (one reading thread only:
        a leaf dropped by one thread could be closed under another's openat)."""
        if self.leaves is None:
            self.leaves = {}

    def read(self, digest: bytes, iovecs, bufs, ranges=None) -> tuple[int, int]:
        h = digest.hex()
        if self.leaves is not None:
            known = self.leaves.get(h[:4])
            if known is not None:
                got = self._read_at(known, h, digest, iovecs, bufs, ranges, remembered=True)
                if got is not None:
                    return got
                # No such file there, or the leaf itself fails (a directory since
                # removed, a network mount since remounted): walk again.
                self._forget_leaf(h[:4])
        try:
            leaf = self._leaf(h, create=False)
        except FileNotFoundError:
            return status.MISS, 0
        except OSError as exc:
            return status.UNREADABLE, exc.errno or 0
        try:
            got = self._read_at(leaf, h, digest, iovecs, bufs, ranges)
        finally:
            if self.leaves is None:
                os.close(leaf)
            else:  # kept for the next read in this leaf
                if len(self.leaves) >= _LEAVES:
                    self._forget_leaf(next(iter(self.leaves)))
                self.leaves[h[:4]] = leaf
        return got if got is not None else (status.MISS, 0)

    def _forget_leaf(self, prefix: str) -> None:
        os.close(self.leaves.pop(prefix))

    def close(self) -> None:
        """Close the leaf directories reads kept open."""
        while self.leaves:
            self._forget_leaf(next(iter(self.leaves)))

    def _read_at(self, leaf: int, h: str, digest: bytes, iovecs, bufs, ranges,
                 remembered: bool = False):
        """The page read in the open leaf directory: (status, errno), or None
        where the leaf holds no file of that name (or, `remembered`, where
        opening in it fails at all: only a fresh walk says why)."""
        name = h + naming.PAGE_SUFFIX
        try:
            fd = os.open(name, _READ_FLAGS | self.open_flags, dir_fd=leaf)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if remembered:
                return None
            return (status.MISS if exc.errno == errno.ESTALE else status.UNREADABLE), exc.errno or 0
        try:
            try:
                st_ = os.fstat(fd)
                mode, size = st_.st_mode, st_.st_size
            except OSError as exc:
                # a network filesystem (FUSE: JuiceFS) may fail fstat of a file
                # replaced since the open (ENOENT): gone, as a failed read says
                return (status.MISS if exc.errno in _GONE else status.UNREADABLE), \
                    exc.errno or 0
            if not stat.S_ISREG(mode):
                # A FIFO, a device node, a directory: no page, and reading it may
                # block (a FIFO, a terminal) or copy a device's bytes. Not moved
                # aside: an operator's business, as other unreadable files are.
                return status.UNREADABLE, _not_a_file_errno(mode)
            if ranges is not None:
                return self._read_ranges(fd, digest, iovecs, bufs, ranges, size)
            want = self.file_bytes
            try:
                got = preadv_full(fd, [bufs.header, *iovecs, bufs.overflow],
                                  want + len(bufs.overflow), self.io.direct)
            except OSError as exc:
                return (status.MISS if exc.errno in _GONE else status.UNREADABLE), exc.errno or 0
            code = self._check(got, want, digest, iovecs, bufs.header)
            if code in _MOVE_ASIDE and self.io.quarantine:
                self._move_aside(leaf, name, fd, code)  # while fd still names the file judged
            elif code == status.OK:
                self._stamp(fd, digest)
            return code, 0
        finally:
            os.close(fd)

    def _read_ranges(self, fd: int, digest: bytes, iovecs, bufs, ranges, size: int) -> tuple[int, int]:
        """A layer group of the page (decision 101): its header, checked as a
        whole read checks it, then each payload run into `iovecs` in order.
        The file's length stands in for the payload's (a whole read sees a
        short or long file; this one reads only part of it), and a flagged
        checksum cannot be verified from part of the payload: that part is
        trusted as an unflagged page is (the engine refuses require_checksum
        with layer parts). The stamp and the quarantine are a whole read's."""
        try:
            if self.io.direct:
                clear_direct(fd)  # runs start at any 4096-aligned header offset, lengths vary
            if preadv_full(fd, [bufs.header], pagefile.HEADER_SIZE) < pagefile.HEADER_SIZE:
                return status.CORRUPT, 0
            code, _crc = pagefile.check_header(bufs.header, self.io.payload_len,
                                               self.io.geometry_fp, digest)
            if code != status.OK:
                return code, 0
            if size != self.file_bytes:
                return status.CORRUPT, 0
            views = list(iovecs)
            for offset, length in ranges:
                dest, views = fileio.split(views, length)
                got = preadv_full(fd, dest, length, offset=pagefile.HEADER_SIZE + offset)
                if got != length:
                    return status.CORRUPT, 0  # shortened under us since the fstat
        except OSError as exc:
            return (status.MISS if exc.errno in _GONE else status.UNREADABLE), exc.errno or 0
        self._stamp(fd, digest)
        return status.OK, 0

    def _check(self, got: int, want: int, digest: bytes, iovecs, header) -> int:
        if got < pagefile.HEADER_SIZE:
            return status.CORRUPT
        code, crc = pagefile.check_header(header, self.io.payload_len, self.io.geometry_fp, digest)
        if code != status.OK:
            return code
        if got != want:  # truncated or longer than a page: never trust it
            return status.CORRUPT
        if crc is None:
            # A reader that requires checksums cannot tell this page from a damaged
            # one: refused, but not moved aside (it is good for other readers).
            return status.UNVERIFIED if self.io.require_crc else status.OK
        if (self.io.verify_crc or self.io.require_crc) and pagefile.payload_crc(iovecs) != crc:
            return status.CORRUPT
        return status.OK

    def _stamp(self, fd: int, digest: bytes) -> None:
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

    def _move_aside(self, leaf: int, name: str, fd: int, code: int) -> None:
        """Best effort: rename a damaged page file into the quarantine directory.

        Only if `name` still names the file that was read: another engine may
        have replaced it with a good page since (a narrow race remains; losing
        it costs one later miss, never wrong bytes).
        """
        try:
            seen = os.fstat(fd)
            now = os.stat(name, dir_fd=leaf, follow_symlinks=False)
            if (seen.st_dev, seen.st_ino) != (now.st_dev, now.st_ino):
                return
            top = os.open(self.root, _DIR_FLAGS)
            try:
                qdir = _subdir(top, naming.QUARANTINE_DIR, create=True)
            finally:
                os.close(top)
            try:
                moved = naming.quarantine_name(name, status.NAMES[code], os.getpid(),
                                               next(self.serials))
                os.rename(name, moved, src_dir_fd=leaf, dst_dir_fd=qdir)
            finally:
                os.close(qdir)
        except OSError:
            pass  # the read is a miss either way

    # --- writes -----------------------------------------------------------------
    def write(self, digest: bytes, iovecs, bufs) -> tuple[int, int]:
        crc = pagefile.payload_crc(iovecs) if (self.io.write_crc or self.io.require_crc) else None
        bufs.write_header[:] = pagefile.build_header(self.io.payload_len, self.io.geometry_fp,
                                                     digest, crc)
        try:
            try:
                self._write_file(digest.hex(), iovecs, bufs)
            except FileNotFoundError:
                # The tree was removed between making the leaf and the rename
                # (an operator emptying the store): once more, from the root.
                self._write_file(digest.hex(), iovecs, bufs)
            return status.OK, 0
        except OSError as exc:
            return _WRITE_ERRNO.get(exc.errno, status.IOERROR), exc.errno or 0

    def _write_file(self, h: str, iovecs, bufs) -> None:
        name = h + naming.PAGE_SUFFIX
        tmp = tmpfiles.tmp_name(name, next(self.serials))
        leaf = self._leaf(h, create=True)
        fd = -1
        try:
            mode = file_mode(os.fstat(leaf).st_mode)
            # With O_DIRECT every run is a whole number of 4096-byte blocks
            # (directio.geometry_aligned), so the file length is too.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
                         | self.open_flags, mode, dir_fd=leaf)
            if mode != OWNER_FILE_MODE:
                os.fchmod(fd, mode)  # open applied the umask (022 takes the group's write)
            vecs = [bufs.write_header, *iovecs]
            gate = None if self.io.direct else getattr(bufs, "gate", None)
            if gate is None:
                pwritev_full(fd, vecs, self.io.direct)
            else:
                at = 0
                for i, piece in enumerate(pieces(vecs)):
                    if i:
                        gate()  # the worker may hold the rest while reads wait
                    pwritev_full(fd, piece, False, at)
                    at += sum(len(v) for v in piece)
            if self.io.fsync == "data":
                os.fdatasync(fd)
            elif self.io.fsync == "always":
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, name, src_dir_fd=leaf, dst_dir_fd=leaf)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=leaf)
            except OSError:
                pass
            raise
        finally:
            os.close(leaf)

    # --- the rest of the interface ---------------------------------------------
    def remove(self, digest: bytes) -> bool:
        try:
            with self._page_at(digest) as (leaf, name):
                os.unlink(name, dir_fd=leaf)
            return True
        except FileNotFoundError:
            return True  # no directory or no file (another engine removed it): gone either way
        except OSError:
            return False

    def touch(self, digest: bytes) -> None:
        try:
            with self._page_at(digest) as (leaf, name):
                os.utime(name, dir_fd=leaf, follow_symlinks=False)
        except OSError:
            pass

    def exists(self, digest: bytes) -> bool:
        try:
            with self._page_at(digest) as (leaf, name):
                st = os.stat(name, dir_fd=leaf, follow_symlinks=False)
        except OSError:
            return False
        # A regular file of a page's size (when this store knows the size).
        return stat.S_ISREG(st.st_mode) and \
            (not self.io.payload_len or st.st_size == self.file_bytes)

    def path(self, digest: bytes) -> str:
        """The page file's path (for tools and tests; I/O goes through the calls above)."""
        return naming.page_path(self.root, digest)

    def scan(self, reap_tmp: bool = False) -> Scan:
        """Every page file (regular files only), every temp file's name and size,
        and the bytes of both; with `reap_tmp`, temp files of dead writers are
        removed (workers.tmpfiles says which)."""
        pages, temps, total, reaped = [], [], 0, 0
        now = time.time()
        for sub in naming.fanout_dirs(self.root):
            try:
                it = os.scandir(sub)
            except OSError:
                continue
            with it:
                for entry in it:
                    digest = naming.digest_from_name(entry.name)
                    if digest is None and not tmpfiles.is_tmp(entry.name):
                        continue
                    try:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # removed under us
                    if digest is not None:
                        pages.append(Page(st.st_mtime_ns, st.st_size, digest))
                    elif reap_tmp and tmpfiles.stale(entry.name, st.st_mtime, now):
                        try:
                            os.unlink(entry.path)
                            reaped += 1
                            continue
                        except OSError:
                            pass
                    if digest is None:
                        temps.append((entry.name, st.st_size))
                    total += st.st_size
        return Scan(pages, total, reaped, tuple(temps))

    def blank(self) -> bool:
        return not naming.has_fanout(self.root)

    def walk(self, reap_tmp: bool = False):
        """Every page file's digest, one leaf directory at a time: yields
        (digests, temp files of dead writers removed there). No stat per page
        (the entry's type comes with the listing on local filesystems): what
        the index needs is names, and a walk of a million pages must cost a
        listing, not a million metadata round trips. Temp files are stat'ed
        only with `reap_tmp` (their age decides, workers.tmpfiles)."""
        now = time.time()
        for sub in naming.fanout_dirs(self.root):
            digests, reaped = [], 0
            try:
                it = os.scandir(sub)
            except OSError:
                continue
            with it:
                for entry in it:
                    name = entry.name
                    digest = naming.digest_from_name(name)
                    try:
                        if digest is not None:
                            if entry.is_file(follow_symlinks=False):
                                digests.append(digest)
                        elif reap_tmp and tmpfiles.is_tmp(name) and \
                                entry.is_file(follow_symlinks=False) and \
                                tmpfiles.stale(name, entry.stat(follow_symlinks=False).st_mtime,
                                               now):
                            os.unlink(entry.path)
                            reaped += 1
                    except OSError:
                        continue  # removed under us
            if digests or reaped:
                yield digests, reaped

    def free_bytes(self, digest: bytes | None = None) -> int | None:
        return free_bytes(self.root)


def _subdir(parent: int, name: str, create: bool) -> int:
    try:
        return os.open(name, _SUB_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    want = dir_mode(os.fstat(parent).st_mode)
    try:
        os.mkdir(name, want, dir_fd=parent)
    except FileExistsError:
        want = None  # another writer made it: its modes stand
    fd = os.open(name, _SUB_FLAGS, dir_fd=parent)
    if want is not None and want != DIR_MODE:
        try:
            have = os.fstat(fd).st_mode
            # mkdir applied the umask; the setgid bit (inherited from a setgid
            # parent) is kept, as the kernel gave it.
            if stat.S_IMODE(have) & 0o777 != want:
                os.fchmod(fd, want | (have & stat.S_ISGID))
        except OSError:
            pass  # the directory works; only another uid's access is narrower
    return fd


def dir_mode(parent_mode: int) -> int:
    """The mode of a directory made in a directory of `parent_mode`: the
    owner's rwx, and the parent's group bits where the parent is setgid;
    nothing for others (decision 100)."""
    return DIR_MODE | (parent_mode & 0o070 if parent_mode & stat.S_ISGID else 0)


OWNER_FILE_MODE = 0o600


def file_mode(dir_mode_: int) -> int:
    """The mode of a page file made in a directory of `dir_mode_`: the owner's
    rw, and the group's read and write where the directory is setgid and gives
    them; nothing for others (decision 100)."""
    return OWNER_FILE_MODE | (dir_mode_ & 0o060 if dir_mode_ & stat.S_ISGID else 0)


def _not_a_file_errno(mode: int) -> int:
    """The errno a read reports for a page path that is not a regular file."""
    if stat.S_ISDIR(mode):
        return errno.EISDIR
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return errno.ESPIPE  # what a positioned read of one says
    return errno.ENODEV      # a device node: no page here

