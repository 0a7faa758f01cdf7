"""Input checks of the engine's public calls: raised before anything is reserved.

Owns what a bad argument is (a timeout, a pool size, a list of host slots)
and the one clear ValueError it gets. Must not touch engine state: each
check is a function of its arguments. The slot check runs on the scheduler's
thread, so it keeps the GIL (shm.gilkeep: min/max in Python, no numpy
reduction).
"""
import math

import numpy as np
import psutil

from shm import gilkeep


def check_pool_size(nbytes: int) -> None:
    """An absurd pool size is a ValueError here, before anything is allocated.

    Whatever backs the host pool (a /dev/shm segment, or a region handed over
    by fd), it needs that much memory; a segment created by the engine is also
    checked against /dev/shm's free space (`shm.hostpool`).
    """
    limit = psutil.virtual_memory().total + psutil.swap_memory().total
    if nbytes > limit:
        raise ValueError(f"a host pool of {nbytes / 2**30:.1f} GiB does not fit in this machine's "
                         f"memory ({limit / 2**30:.1f} GiB): lower host_pool_pages or the page size")


def check_timeout(timeout_s, name: str = "timeout_s"):
    """A timeout in seconds as a float, or None for none (None or inf);
    ValueError for anything else: a string, a bool, a negative number, NaN."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"{name} must be a number of seconds or None, got {timeout_s!r}")
    if not timeout_s >= 0:  # also NaN
        raise ValueError(f"{name} must be >= 0 (or None / inf for no timeout), got {timeout_s!r}")
    return None if math.isinf(timeout_s) else float(timeout_s)


def check_pages(host_pages, nkeys: int, limit: int) -> np.ndarray:
    """`host_pages` as int64 slots for an op of `nkeys` keys in a pool of
    `limit` pages; ValueError for anything else (before anything is reserved)."""
    try:
        pages = np.asarray(host_pages)
    except Exception as exc:
        raise ValueError(f"host_pages must be a sequence of ints: {exc}") from None
    if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "iu"):
        raise ValueError(f"host_pages must be a 1-D sequence of ints, got dtype {pages.dtype} "
                         f"shape {pages.shape}")
    listed = pages.tolist()  # min/max in Python: numpy's reductions may let the GIL go
    if pages.size and pages.dtype.kind == "u" and max(listed) > np.iinfo(np.int64).max:
        raise ValueError(f"host page {max(listed)} out of range")  # before the cast wraps it
    pages = pages.astype(np.int64, copy=False)
    if len(pages) != nkeys:
        raise ValueError(f"{nkeys} keys but {len(pages)} host pages")
    if len(pages) > limit:
        raise ValueError(f"op of {len(pages)} pages exceeds the host pool ({limit} pages)")
    if len(pages):
        lo, hi = min(listed), max(listed)
        if lo < 0 or hi >= limit:
            raise ValueError(f"host page {lo if lo < 0 else hi} out of range [0, {limit})")
        if gilkeep.repeats(pages):
            raise ValueError("host pages repeat within one op")
    return pages
