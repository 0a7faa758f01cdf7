"""Array steps that keep the GIL: what the scheduler's threads do per batch.

Owns the few numpy operations the engine and its adapters run on a caller's
thread (record building, ring copies, the pin table, duplicate checks, the
per-page masks of an SGLang or vLLM batch), done so that none lets the GIL
go, each written once here. Must not sleep, block or do I/O.

Why: under a scheduler loop that holds the GIL (a pure-Python batch
builder), a thread that gives the GIL up waits up to a whole switch interval
(5 ms) to win it back. numpy gives it up inside its loops: always in
`ufunc.at`, sorts and `np.unique` (whatever the size), and in copies, casts,
fills and fancy-index stores over more than 500 elements
(NPY_BEGIN_THREADS_THRESHOLDED), around the calloc of `np.zeros` from 1 KiB
up, and in a fancy index given as uint64 (its cast). So: no `ufunc.at`, sort or unique here;
duplicates are found with a Python set (C, GIL held); bulk copies are
`memoryview` slice assignments (one memcpy, GIL held); and fancy-index
steps go in chunks of `CHUNK` elements. tests/test_gil_hold.py checks the
engine's calls for any release, on whatever numpy is installed.
"""
import collections

import numpy as np

CHUNK = 256  # elements per numpy step: under numpy's 500-element threshold
# np.arange's fill lets the GIL go whatever the length: slices of this instead
_IOTA = np.arange(1 << 16, dtype=np.int64)
_IOTA.flags.writeable = False


def iota(n: int, start: int = 0) -> np.ndarray:
    """np.arange(start, start + n) as int64 (a new array only past 65536)."""
    if n > len(_IOTA):
        return np.arange(start, start + n, dtype=np.int64)
    return _IOTA[:n] + start if start else _IOTA[:n]


def zeros(n: int, dtype) -> np.ndarray:
    """A zeroed, writable array: bytearray's calloc, GIL held (numpy's
    np.zeros lets the GIL go around its calloc from 1 KiB up)."""
    dtype = np.dtype(dtype)
    return np.frombuffer(bytearray(n * dtype.itemsize), dtype=dtype)


def copy(src: np.ndarray) -> np.ndarray:
    """A contiguous copy of a 1-D array (one memcpy)."""
    src = np.ascontiguousarray(src) if not src.flags.c_contiguous else src
    out = np.frombuffer(bytearray(src.nbytes), dtype=src.dtype)
    put_bytes(out, src)
    return out


def put_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for contiguous arrays of the same dtype and length (memcpy)."""
    # through uint8 views: a structured dtype's memoryview does not cast
    memoryview(dst.reshape(-1).view(np.uint8))[:] = memoryview(src.reshape(-1).view(np.uint8))


def concat(parts, dtype) -> np.ndarray:
    """np.concatenate of contiguous 1-D arrays, by memcpy."""
    n = sum(len(p) for p in parts)
    out = np.frombuffer(bytearray(n * np.dtype(dtype).itemsize), dtype=dtype)
    at = 0
    for p in parts:
        put_bytes(out[at:at + len(p)], np.ascontiguousarray(p))
        at += len(p)
    return out


def assign(dst: np.ndarray, src) -> None:
    """dst[:] = src (an array of any strides, or a scalar), in chunks."""
    n = len(dst)
    if n <= CHUNK:
        dst[:] = src
        return
    scalar = np.ndim(src) == 0
    for a in range(0, n, CHUNK):
        dst[a:a + CHUNK] = src if scalar else src[a:a + CHUNK]


def full(n: int, value, dtype) -> np.ndarray:
    """np.full without numpy's allocator (it lets the GIL go around calloc
    from 1 KiB up) or an unchunked fill."""
    out = zeros(n, dtype)
    if value:
        assign(out, value)
    return out


def _bool_bytes(mask) -> bytes:
    return np.ascontiguousarray(mask, dtype=bool).tobytes()


# numpy's reductions (any, all, sum, argmax, count_nonzero) may let the GIL go
# whatever the length: over bool masks these scan bytes (C, GIL held).
def any_(mask) -> bool:
    return b"\x01" in _bool_bytes(mask)


def all_(mask) -> bool:
    return b"\x00" not in _bool_bytes(mask)


def count(mask) -> int:
    """Trues in a bool mask."""
    return _bool_bytes(mask).count(b"\x01")


def first_false(mask) -> int:
    """Index of the first False (len(mask) if none): np.argmin for a bool mask
    that has a False."""
    b = _bool_bytes(mask)
    i = b.find(b"\x00")
    return len(b) if i < 0 else i


def total(values) -> int:
    """sum of a small int array (Python's sum over its list)."""
    return sum(values.tolist())


def eq(values: np.ndarray, value) -> np.ndarray:
    """values == value as a bool array, in chunks."""
    n = len(values)
    if n <= CHUNK:
        return values == value
    out = zeros(n, bool)
    for a in range(0, n, CHUNK):  # into `out` itself: no temporary per chunk
        np.equal(values[a:a + CHUNK], value, out=out[a:a + CHUNK])
    return out


def either(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a | b of two bool masks of one length, in chunks."""
    out = zeros(len(a), bool)
    for i in range(0, len(a), CHUNK):
        np.logical_or(a[i:i + CHUNK], b[i:i + CHUNK], out=out[i:i + CHUNK])
    return out


def where(mask: np.ndarray, value: bool = True) -> np.ndarray:
    """Positions where the bool `mask` is `value` (np.flatnonzero(mask), or
    of ~mask for False) as int64, in chunks."""
    n = len(mask)
    if n <= CHUNK:
        return np.flatnonzero(mask if value else ~mask).astype(np.int64)
    if value:
        return concat([np.flatnonzero(mask[a:a + CHUNK]) + a for a in range(0, n, CHUNK)],
                      np.int64)
    return concat([np.flatnonzero(~mask[a:a + CHUNK]) + a for a in range(0, n, CHUNK)], np.int64)


def repeats(values) -> bool:
    """Does the 1-D int array or list hold a value twice?"""
    lst = values.tolist() if isinstance(values, np.ndarray) else list(values)
    return len(set(lst)) != len(lst)


def set_at(table: np.ndarray, idx: np.ndarray, value) -> None:
    """table[idx] = value, in chunks."""
    n = len(idx)
    if n <= CHUNK:
        table[idx] = value
        return
    scalar = np.ndim(value) == 0
    for a in range(0, n, CHUNK):
        table[idx[a:a + CHUNK]] = value if scalar else value[a:a + CHUNK]


def take(table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """table[idx], in chunks."""
    n = len(idx)
    if n <= CHUNK:
        return table[idx]
    return concat([table[idx[a:a + CHUNK]] for a in range(0, n, CHUNK)], table.dtype)


def add_at(table: np.ndarray, idx: np.ndarray, delta: int, unique: bool = False) -> None:
    """np.add.at(table, idx, delta): an index given k times adds k * delta.
    `unique`: the caller knows no index repeats (the check is most of the
    cost: a set of the indices)."""
    step = np.asarray(abs(delta), dtype=table.dtype)
    lst = None if unique else idx.tolist()
    if unique or len(set(lst)) == len(lst):
        keys, times = idx, None
    else:  # Counter's loop is C (collections._count_elements): GIL held
        counts = collections.Counter(lst)
        keys = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        times = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
    for a in range(0, len(keys), CHUNK):
        part = keys[a:a + CHUNK]
        amount = step if times is None else (times[a:a + CHUNK] * abs(delta)).astype(table.dtype)
        if delta >= 0:
            table[part] += amount
        else:
            table[part] -= amount
