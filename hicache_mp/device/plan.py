"""Copy planning for the DeviceLoader: which page pairs merge into one copy, and which method to use.

Owns pure index math on numpy arrays (runs of consecutive pages, the method
choice). Must not import torch or touch memory: the loader turns a plan into
copies and kernels.
"""
import numpy as np

PAGE_FIRST, LAYER_FIRST = "page_first", "layer_first"
MEMCPY, GATHER = "memcpy", "gather"
METHODS = ("auto", MEMCPY, GATHER)

# A DMA copy (cudaMemcpyAsync) reaches full PCIe rate only once it is large: each
# costs a few microseconds to issue from Python/the driver, and 128 KiB moves in
# about 2.4 us at 55 GB/s. Below this average size the zero-copy gather kernel
# (one launch for the whole batch) wins.
MIN_COPY_BYTES = 1 << 20

# layer_first gathers go one layer at a time (so a forward pass can start on
# layer 0) only for batches at least this big: below it the 3 launches per
# layer cost more host time than the layer's bytes take on PCIe, and one
# gather of all layers plus one scatter is faster (4.6 -> tens of GB/s for one page).
PER_LAYER_MIN_PAGES = 16


def by_host(host: np.ndarray, dev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Page pairs sorted by host page, so consecutive host slots become one run."""
    order = np.argsort(host, kind="stable")
    return host[order], dev[order]


def runs(*indices: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) positions where every index array steps by exactly +1."""
    n = len(indices[0])
    if n == 0:
        return []
    step = np.ones(n - 1, dtype=bool)
    for idx in indices:
        step &= np.diff(idx) == 1
    breaks = (np.flatnonzero(~step) + 1).tolist()
    starts = [0] + breaks
    ends = breaks + [n]
    return list(zip(starts, ends))


def copy_runs(layout: str, host: np.ndarray, dev: np.ndarray) -> list[tuple[int, int]]:
    """The DMA copies the memcpy method needs, for pairs already sorted by host page.

    page_first: a host run lands in device staging in order, so only the host
    side must be consecutive (the device scatter handles any device order).
    layer_first: copies go straight into the KV buffers, per (kv, layer) plane,
    so host and device pages must both be consecutive.
    """
    return runs(host) if layout == PAGE_FIRST else runs(host, dev)


def choose(method: str, layout: str, n: int, num_runs: int, page_bytes: int, run_bytes: int,
           can_gather: bool) -> str:
    """The method for one batch: memcpy when its copies are big, gather otherwise."""
    if method != "auto":
        return method if (method == MEMCPY or can_gather) else MEMCPY
    if not can_gather or n == 0:
        return MEMCPY
    unit = page_bytes if layout == PAGE_FIRST else run_bytes  # bytes one page adds to one copy
    return MEMCPY if unit * n / max(num_runs, 1) >= MIN_COPY_BYTES else GATHER


def check_pages(pages, limit: int, what: str) -> np.ndarray:
    try:
        arr = np.asarray(pages)
    except Exception as exc:
        raise ValueError(f"{what} must be a sequence of ints: {exc}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{what} must be a 1-D sequence of ints, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= limit:
            raise ValueError(f"{what}: page {lo if lo < 0 else hi} out of range [0, {limit})")
        if len(np.unique(arr)) != len(arr):
            raise ValueError(f"{what} repeat a page")
    return arr
