"""SGLang's host indices as page numbers, GIL held.

Owns the index steps every SGLang storage call makes on SGLang's threads (v1's
KV batches, v2's sidecar batches): host indices to each page's first index and
page number. They keep the GIL (shm.gilkeep's rules): chunks of
gilkeep.CHUNK, bytes compares instead of reductions, no `.cpu()` of a CPU
tensor. The per-page masks of a batch (the positions still to write, the
pages that landed) are shm.gilkeep's `where` and `eq`, which the vLLM tier
runs too. Must not call the engine or torch beyond viewing a tensor.
"""
import ctypes

import numpy as np
import torch

from shm import gilkeep


def as_numpy(indices) -> np.ndarray:
    """Host indices as numpy, for the length of the SGLang call that gave them.

    A contiguous int64 CPU tensor (SGLang's host indices are) is read in place
    through its data pointer: no torch op (every one lets the GIL go, and under
    a busy scheduler each release costs the storage thread up to a switch
    interval to get it back), and no `.numpy()` view either, whose release
    when it is dropped lets the GIL go too. The array holds no reference to
    the tensor: nothing derived from it may outlive the call (the callers copy:
    page_starts). Other tensors take `.numpy()` (or `.cpu()` off the host)."""
    if isinstance(indices, torch.Tensor):
        if indices.is_cpu and indices.dtype == torch.int64 and indices.is_contiguous():
            n = indices.numel()
            if not n:
                return np.zeros(0, dtype=np.int64)
            raw = (ctypes.c_int64 * n).from_address(indices.data_ptr())
            return np.frombuffer(raw, dtype=np.int64).reshape(tuple(indices.shape))
        return (indices if indices.is_cpu else indices.cpu()).numpy()
    return np.asarray(indices)


def page_starts(idx: np.ndarray, n: int, P: int):
    """(each page's first host index as int64, all on a page boundary), in
    gilkeep's chunks (numpy lets the GIL go in casts and ufuncs over more
    than 500 elements)."""
    flat = idx.reshape(-1)
    starts = gilkeep.zeros(n, np.int64)
    gilkeep.assign(starts, flat if P == 1 else gilkeep.take(flat, gilkeep.iota(n * P)[::P]))
    aligned = True
    if P > 1:   # a reduction (.any()) lets the GIL go at any size: compare bytes
        for a in range(0, n, gilkeep.CHUNK):
            rem = starts[a:a + gilkeep.CHUNK] % P
            aligned = aligned and rem.tobytes() == bytes(rem.nbytes)
    return starts, aligned


def page_index(starts: np.ndarray, P: int) -> np.ndarray:
    """starts // P (page numbers), chunked."""
    if P == 1:
        return starts
    pages = gilkeep.copy(starts)
    for a in range(0, len(pages), gilkeep.CHUNK):
        pages[a:a + gilkeep.CHUNK] //= P
    return pages


def host_pages(n: int, host_indices, P: int) -> np.ndarray:
    """The host pool's page number of each of `n` pages given as `n * P` host
    indices (int64); ValueError where they are not `n` whole pages."""
    idx = as_numpy(host_indices)
    if idx.ndim != 1 or len(idx) != n * P:
        raise ValueError(f"hicache_mp: {n} keys need {n * P} host indices "
                         f"(page size {P}), got shape {tuple(idx.shape)}")
    starts, aligned = page_starts(idx, n, P)
    if not aligned:
        raise ValueError("hicache_mp: a page's host indices do not start on a page boundary")
    return page_index(starts, P)

