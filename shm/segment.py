"""One POSIX shared-memory segment, mapped into this process.

Owns create/attach/map/unlink of a single named region (or of a region handed
over as a file descriptor, such as SGLang's memfd host pool), and the room
check for /dev/shm. Must not know what the bytes mean: rings, pools and
control blocks build on top.

Every segment this module creates is allocated in full at creation
(posix_fallocate): tmpfs lets ftruncate make a segment larger than the room it
has, and a process that later touches a page tmpfs cannot supply dies of
SIGBUS. Allocated up front, a full /dev/shm is an error at creation
(ShmFullError), and nothing another process puts in /dev/shm later can take
those pages away.
"""
import errno
import mmap
import os

import posix_ipc

from .names import SHM_DIR

DEFAULT_MODE = 0o600


class ShmFullError(OSError):
    """/dev/shm has no room for what an engine needs (raised before any worker starts)."""


def shm_free_bytes() -> int | None:
    """Bytes free in /dev/shm, or None where there is none (another platform)."""
    try:
        vfs = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def check_room(nbytes: int, what: str) -> None:
    """ValueError if `nbytes` more cannot fit in /dev/shm now: a size that cannot
    work here, refused before anything is created (as an absurd size is)."""
    free = shm_free_bytes()
    if free is not None and nbytes > free:
        raise ValueError(f"{what} ({nbytes / 2**20:.1f} MiB) does not fit in {SHM_DIR} "
                         f"({free / 2**20:.1f} MiB free): lower host_pool_pages or the page "
                         f"size, or free {SHM_DIR}")


class Segment:
    """A mapped shared-memory region.

    The creator owns the name and unlinks it on `close()`; an attacher only
    unmaps. `populate=True` maps with MAP_POPULATE so a worker takes no page
    faults in the middle of a read (those faults would halve one worker's rate).
    """

    def __init__(self, name: str, size: int, *, create: bool, mode: int = DEFAULT_MODE,
                 populate: bool = False, fd: int | None = None):
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        self.name = name
        self.size = size
        self.owner = create
        self._unlinked = False
        if fd is not None:
            # A region someone else created (e.g. a memfd): map it, never unlink it.
            self.owner = False
            self._unlinked = True
            self.map = self._map(fd, size, populate)
            return
        if create:
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=mode, size=size)
            # shm_open applies the umask; force the mode we promised.
            os.fchmod(shm.fd, mode)
        else:
            shm = posix_ipc.SharedMemory("/" + name)
            if shm.size < size:
                shm.close_fd()
                raise ValueError(f"segment {name} holds {shm.size} bytes, expected {size}")
        try:
            if create:
                _allocate(shm.fd, size, name)
            self.map = self._map(shm.fd, size, populate)
        except BaseException:
            if create:
                shm.unlink()
            raise
        finally:
            shm.close_fd()

    @staticmethod
    def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
        flags = mmap.MAP_SHARED
        if populate and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, name: str, size: int, **kw) -> "Segment":
        return cls(name, size, create=True, **kw)

    @classmethod
    def attach(cls, name: str, size: int, **kw) -> "Segment":
        return cls(name, size, create=False, **kw)

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until unmapped."""
        if self.owner and not self._unlinked:
            self._unlinked = True
            try:
                posix_ipc.unlink_shared_memory("/" + self.name)
            except posix_ipc.ExistentialError:
                pass

    def close(self) -> None:
        self.unlink()
        try:
            self.map.close()
        except BufferError:
            # A torch/numpy view still exports the buffer; the mapping goes
            # when the last view does. The name is already gone.
            pass

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size} bytes, owner={self.owner})"


def _allocate(fd: int, size: int, name: str) -> None:
    """Give the segment all its pages now (module docstring), or ShmFullError."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise ShmFullError(errno.ENOSPC, f"{SHM_DIR} has no room for {name} "
                               f"({size / 2**20:.1f} MiB): free {SHM_DIR} or lower "
                               f"host_pool_pages") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
