"""Which shared file backs a buffer, so the engine's workers can map the same bytes.

A framework may hand an adapter a buffer over shared memory without the file
behind it: vLLM gives its secondary tiers a memoryview over its CPU tier, the
mmap of /dev/shm/vllm_offload_<engine_id>.mmap. `/proc/self/maps` says which
file a range of addresses maps, at which file offset, and whether the mapping
is shared; `open_region` then opens that file again, by its path (checked to
be the same inode) or, for a file unlinked since it was mapped, through a
descriptor of this process that names the same inode (its owner keeps one
open). A private mapping is refused: what workers write to the file would not
be seen through it. Must not map, resize or write anything.
"""
import os
from dataclasses import dataclass

import numpy as np

DELETED = " (deleted)"


class RegionNotShared(ValueError):
    """The buffer is not one shared mapping of a file that can be opened again."""


@dataclass(frozen=True)
class FileRegion:
    path: str        # as /proc/self/maps names it (may end in " (deleted)")
    dev: tuple       # (major, minor) of the file's device
    inode: int
    offset: int      # file offset of the buffer's first byte
    nbytes: int
    start: int       # the mapping's first address (for /proc/self/map_files)
    end: int


def buffer_span(buf) -> tuple[int, int]:
    """(address, bytes) of a C-contiguous buffer."""
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise RegionNotShared("the buffer is not contiguous")
    if mv.nbytes == 0:
        raise RegionNotShared("the buffer is empty")
    flat = mv.cast("B") if (mv.ndim != 1 or mv.format != "B") else mv
    return int(np.frombuffer(flat, dtype=np.uint8, count=1).ctypes.data), mv.nbytes


def _maps(maps_path: str):
    with open(maps_path) as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 5:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            path = parts[5].rstrip("\n") if len(parts) > 5 else ""
            yield lo, hi, parts[1], int(parts[2], 16), (major, minor), int(parts[4]), path


def file_region(buf, maps_path: str = "/proc/self/maps") -> FileRegion:
    """The shared file mapping that holds all of `buf`, or RegionNotShared.

    A mapping the kernel keeps as several adjacent areas (same file, offsets
    continuing) counts as one."""
    addr, nbytes = buffer_span(buf)
    found = None
    for lo, hi, perms, off, dev, inode, path in _maps(maps_path):
        if found is None:
            if lo <= addr < hi:
                found = [lo, hi, perms, off + (addr - lo), dev, inode, path]
        elif lo == found[1] and (dev, inode, path) == tuple(found[4:7]) \
                and off == found[3] - (addr - found[0]) + (lo - found[0]) and perms == found[2]:
            found[1] = hi
        if found is not None and found[1] >= addr + nbytes:
            break
    if found is None:
        raise RegionNotShared("no mapping holds the buffer's address")
    lo, hi, perms, offset, dev, inode, path = found
    if not inode or not path.startswith("/"):
        raise RegionNotShared(f"the buffer is not a file mapping ({path or 'anonymous'})")
    if "s" not in perms or "w" not in perms:
        raise RegionNotShared(f"the mapping of {path} is {perms}, not shared and writable")
    if hi < addr + nbytes:
        raise RegionNotShared(f"the buffer runs past its mapping of {path} (several files?)")
    return FileRegion(path, dev, inode, offset, nbytes, lo, hi)


def _same(fd: int, region: FileRegion) -> bool:
    st = os.fstat(fd)
    return st.st_ino == region.inode and (os.major(st.st_dev), os.minor(st.st_dev)) == region.dev


def open_region(region: FileRegion) -> int:
    """A new read-write descriptor of the region's file (the caller closes it)."""
    tried = []
    candidates = []
    if not region.path.endswith(DELETED):
        candidates.append(region.path)
    try:
        candidates += [f"/proc/self/fd/{n}" for n in os.listdir("/proc/self/fd")]
    except OSError as exc:
        tried.append(f"/proc/self/fd: {exc.strerror}")
    candidates.append(f"/proc/self/map_files/{region.start:x}-{region.end:x}")
    for path in candidates:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_ino != region.inode:
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            tried.append(f"{path}: {exc.strerror}")
            continue
        if _same(fd, region):
            if os.fstat(fd).st_size < region.offset + region.nbytes:
                os.close(fd)
                raise RegionNotShared(f"{region.path} is smaller than its mapping")
            return fd
        os.close(fd)
    raise RegionNotShared(f"cannot open {region.path} again for reading and writing"
                          + (f" ({'; '.join(tried)})" if tried else ""))
