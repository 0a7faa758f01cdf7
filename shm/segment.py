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


# What makes a container's /dev/shm larger: every shortfall names it.
SHM_SIZE_FIX = ("a larger /dev/shm: `docker run --shm-size=<size>` (Docker's default is 64 MiB), "
                "or in Kubernetes an emptyDir volume with `medium: Memory` and "
                "`sizeLimit: <size>` mounted at /dev/shm")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class ShmFullError(OSError, ValueError):
    """/dev/shm has no room for what an engine needs: at the room check, before
    anything is made, or when a segment's pages are allocated (ENOSPC).

    Names the path, the bytes needed and free, each part (`parts`: (key,
    label, bytes) in the order they are made: pool, control block, rings),
    which of them do not fit (`short`: their keys) and `fixes`. A ValueError
    too, as io.UnsupportedOperation is: a size that cannot work here, refused
    as an absurd size is. A caller that knows better fixes (a framework's
    settings) raises `with_fixes(...)` in its place."""

    def __init__(self, needed: int, free: int | None, *, parts=(), fixes=(),
                 what: str = "this engine's shared memory", total: int | None = None,
                 path: str = SHM_DIR):
        self.needed, self.free, self.total, self.path, self.what = needed, free, total, path, what
        self.parts = tuple(parts)
        self.fixes = tuple(fixes)
        self.short = self._short()
        super().__init__(errno.ENOSPC, self._message())

    def with_fixes(self, fixes) -> "ShmFullError":
        return ShmFullError(self.needed, self.free, parts=self.parts, fixes=fixes,
                            what=self.what, total=self.total, path=self.path)

    def _short(self) -> tuple:
        """Keys of the parts that do not fit, made in order into what is free."""
        if self.free is None:
            return tuple(key for key, _, _ in self.parts)
        used = 0
        for i, (_, _, nbytes) in enumerate(self.parts):
            used += nbytes
            if used > self.free:
                return tuple(key for key, _, _ in self.parts[i:])
        return ()

    def _message(self) -> str:
        free = "?" if self.free is None else _mib(self.free)
        of = "" if self.total is None else f" of {_mib(self.total)}"
        msg = f"{self.what} does not fit in {self.path}: {_mib(self.needed)} needed"
        if self.parts:
            msg += " (" + ", ".join(f"{label} {_mib(n)}" for _, label, n in self.parts) + ")"
        msg += f", {free} free{of}."
        labels = {key: label for key, label, _ in self.parts}
        if self.short and len(self.parts) > 1:
            fit = [labels[k] for k, _, _ in self.parts if k not in self.short]
            miss = [labels[k] for k in self.short]
            lost = _mib(sum(n for k, _, n in self.parts if k in self.short))
            msg += (f" The {miss[0]} alone does not fit." if not fit else
                    f" The {' and '.join(fit)} fit; not the {' and '.join(miss)} ({lost}).")
        if self.fixes:
            msg += " Fixes: " + "; or ".join(self.fixes) + "."
        return msg


def shm_free_bytes() -> int | None:
    """Bytes free in /dev/shm, or None where there is none (another platform)."""
    vfs = _shm_statvfs()
    return None if vfs is None else vfs.f_bavail * vfs.f_frsize


def shm_total_bytes() -> int | None:
    """The size of /dev/shm, or None where there is none."""
    vfs = _shm_statvfs()
    return None if vfs is None else vfs.f_blocks * vfs.f_frsize


def _shm_statvfs():
    try:
        return os.statvfs(SHM_DIR)
    except OSError:
        return None


def check_room(parts, what: str, fixes=(SHM_SIZE_FIX,)) -> None:
    """ShmFullError if `parts` ((key, label, bytes) each, or one byte count)
    cannot fit in /dev/shm now: refused before anything is created."""
    needed = parts if isinstance(parts, int) else sum(n for _, _, n in parts)
    parts = () if isinstance(parts, int) else parts
    free = shm_free_bytes()
    if free is not None and needed > free:
        raise ShmFullError(needed, free, parts=parts, fixes=fixes, what=what,
                           total=shm_total_bytes())


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
            # The caller (the engine) knows the parts and the settings: it
            # raises its own with_fixes-style error in place of this one.
            raise ShmFullError(size, shm_free_bytes(), parts=[("segment", name, size)],
                               fixes=(SHM_SIZE_FIX,), what=name,
                               total=shm_total_bytes()) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
