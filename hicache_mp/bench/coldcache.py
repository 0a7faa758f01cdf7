"""Making files cold for a benchmark: the kernel's page cache of them emptied.

Owns the one way the benches do it: a sync, then, where asked and allowed,
the machine's `/proc/sys/vm/drop_caches`, else `posix_fadvise(DONTNEED)` on
each file (which leaves other processes' cache alone). Must not read or
write the files' bytes.
"""
import os


def drop_cache(paths, *, machine_level: int | None = None) -> str:
    """Empty the page cache of `paths`; with `machine_level` (1: page cache,
    3: also dentries and inodes), the whole machine's first where this process
    may. Returns the method that worked: "drop_caches" or "fadvise_dontneed"."""
    os.sync()
    if machine_level is not None:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write(f"{machine_level}\n")
            return "drop_caches"
        except OSError:
            pass
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"
