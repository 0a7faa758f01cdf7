"""Tools the storage tests share: mounts, page-cache residency, worker pids.

Torch-free, like faultkit (which these tests also use for page contents).
"""
import ctypes
import mmap
import os
import signal
import subprocess

import pytest


from workers import directio  # noqa: E402

# 64 KiB pages whose runs are 4096-byte multiples in every layout: O_DIRECT-able.
ALIGNED = dict(num_layers=4, num_kv_heads=4, head_dim=64, page_size=16)
FILE_BYTES = 4096 + 4 * 4 * 64 * 16 * 2 * 2


def mount(path: str, fstype: str, *opts) -> bool:
    if os.geteuid() != 0:
        return False
    cmd = ["mount", "-t", fstype] + (["-o", ",".join(opts)] if opts else []) + [fstype, path]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def umount(path: str) -> None:
    subprocess.run(["umount", "-l", path], check=False)


def raw_direct_ok(directory: str) -> bool:
    """Independent of workers.directio: does an O_DIRECT open + aligned write work here?"""
    path = os.path.join(directory, "raw-odirect-check")
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


_libc = ctypes.CDLL(None, use_errno=True)


def resident_pages(path: str) -> int:
    """Pages of `path` in the page cache (mincore over a read-only mapping of it)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_long]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * n)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(v & 1 for v in vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def stop_workers(eng) -> list[int]:
    pids = eng.worker_pids()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def cont(pids) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def store_bytes(root: str) -> int:
    """Bytes of page and temp files in the store's fan-out directories."""
    total = 0
    for d, _, files in os.walk(root):
        if os.path.basename(d) == "quarantine" or d == root:  # top level: the eviction lease
            continue
        for f in files:
            try:
                total += os.stat(os.path.join(d, f)).st_size
            except FileNotFoundError:
                pass
    return total


def need_root():
    if os.geteuid() != 0:
        pytest.skip("needs root to mount filesystems")


__all__ = ["ALIGNED", "FILE_BYTES", "mount", "umount", "raw_direct_ok", "resident_pages",
           "drop_cache", "stop_workers", "cont", "store_bytes", "need_root", "directio"]
