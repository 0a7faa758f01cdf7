"""How much of the workload's stored prefix sits in the page cache before a run.

Owns one measurement: the share of the page files' bytes that the kernel
holds in memory, for the first request's prefix and for every request's
(mincore over a read-only mapping of each file, made and dropped at once).
A buffered read of a resident page is a memory copy; of a dropped one, a disk
read, some ten times slower on the H200 box (decision 18). Before its first
batch the GPU waits for the first request's prefetch (hicache_mp.bench.sim.gputime),
so that request's share says which of the two the run's start paid. Must not
read page bytes nor change what is resident: the mapping is never touched.
"""
from __future__ import annotations

import ctypes
import mmap
import os

from shm.libc import loader
from workers import naming

_PAGE = os.sysconf("SC_PAGE_SIZE")
_FAILED = ctypes.c_void_p(-1).value
# CDLL (the GIL let go): measured before a run, on no scheduler's thread
_lib = loader(ctypes.CDLL, {
    "mmap": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]),
    "munmap": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
    "mincore": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]),
})


def file_resident(path: str) -> tuple[int, int]:
    """(memory pages of `path` in the page cache, memory pages of `path`)."""
    lib = _lib()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return 0, 0
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            n = -(-size // _PAGE)
            vec = ctypes.create_string_buffer(n)
            if lib.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return n - vec.raw[:n].count(0), n   # bit 0 set: resident
        finally:
            lib.munmap(addr, size)
    finally:
        os.close(fd)


def resident_share(store, namespace: str, requests, page_size: int) -> dict | None:
    """{first_request, all}: shares (0..1) of the prefix pages' bytes in the page
    cache; None where the store has no page paths or the system no mincore."""
    if not hasattr(store, "path"):
        return None
    try:
        per_request = []
        for r in requests:
            have = total = 0
            for key in r.page_keys(page_size):
                try:
                    a, b = file_resident(store.path(naming.key_digest(key, namespace)))
                except FileNotFoundError:
                    a, b = 0, 0
                have, total = have + a, total + b
            per_request.append((have, total))
    except (OSError, AttributeError):
        return None
    have = sum(h for h, _ in per_request)
    total = sum(t for _, t in per_request)
    first = per_request[0] if per_request else (0, 0)
    return {"first_request": first[0] / first[1] if first[1] else None,
            "all": have / total if total else None}
