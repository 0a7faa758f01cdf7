"""One POSIX shared-memory segment, mapped into this process.

Owns create/attach/map/unlink of a single named region (or of a region handed
over as a file descriptor, such as SGLang's memfd host pool). Must not know
what the bytes mean: rings, pools and control blocks build on top.
"""
import mmap
import os

import posix_ipc

DEFAULT_MODE = 0o600


class Segment:
    """A mapped shared-memory region.

    The creator owns the name and unlinks it on `close()`; an attacher only
    unmaps. `populate=True` maps with MAP_POPULATE so a worker takes no page
    faults in the middle of a read (DESIGN.md §1: it doubles one worker's rate).
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
