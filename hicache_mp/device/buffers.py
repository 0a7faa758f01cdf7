"""Set-up for the DeviceLoader: the device KV cache and the word views the copies go through.

Owns the device K/V buffers (allocated as one tensor, or the caller's checked
and adopted), their per-(kv, layer) word views and the fused view over all of
them when they sit on one regular grid, and the host pool's views: as
[host page, kv, layer, W] words, and through its CUDA registration's device
mapping (what a zero-copy gather reads). Must not issue copies or keep state:
`DeviceLoader` holds what these return, `copies` moves the bytes.
"""
import torch

from . import plan
from .cuda import HostRegistration, mapped_bytes


def kv_buffers(g, device, word, num_device_pages, k_buffers, v_buffers):
    """(num_device_pages, k_buffers, v_buffers, bufw, fused) for geometry `g`.

    `bufw[kv][layer]`: [device page, run words], one row one page of one layer.
    `fused`: one [kv, layer, page, W] view over them all, or None.
    """
    kvn, L, P = g.kv_count, g.num_layers, g.page_size
    dtype = getattr(torch, g.dtype)
    if k_buffers is None:
        if not isinstance(num_device_pages, int) or num_device_pages <= 0:
            raise ValueError("give num_device_pages (a positive int) or k_buffers/v_buffers")
        base = torch.empty((kvn, L, num_device_pages * P, g.num_kv_heads, g.head_dim),
                           dtype=dtype, device=device)
        buffers = [[base[kv, layer] for layer in range(L)] for kv in range(kvn)]
    else:
        if kvn == 2 and v_buffers is None:
            raise ValueError("v_buffers is required unless the geometry is MLA")
        buffers = [list(k_buffers)] + ([list(v_buffers)] if kvn == 2 else [])
        ok = all(len(row) == L for row in buffers) and all(
            b.dim() == 3 and tuple(b.shape[1:]) == (g.num_kv_heads, g.head_dim) and b.dtype == dtype
            and b.is_contiguous() and b.device == device for row in buffers for b in row)
        if not ok:
            raise ValueError(f"K/V buffers must be {L} contiguous [tokens, {g.num_kv_heads}, "
                             f"{g.head_dim}] {g.dtype} tensors on one device")
        num_device_pages = min(b.shape[0] for row in buffers for b in row) // P
        if num_device_pages <= 0:
            raise ValueError("K/V buffers hold less than one page")
    bufw = [[b[:num_device_pages * P].reshape(num_device_pages, -1).view(word)
             for b in row] for row in buffers]
    return (num_device_pages, buffers[0], buffers[1] if kvn == 2 else None, bufw, _fuse(bufw))


def host_views(pool, g, word, W, device, cuda: bool, method: str):
    """(host4, mapped4, registration) of `pool`: its [host page, kv, layer, W] words,
    the same through its device mapping (None without one), and its CUDA
    registration (None on the CPU). On the CPU, "gather" is plain index_select
    over the host view itself."""
    N, kvn, L = pool.num_pages, g.kv_count, g.num_layers
    host = pool.tensor
    flat = host.reshape(-1).view(torch.uint8)
    host4 = _host4(flat.view(word), g.layout, N, kvn, L, W)
    mapped4 = registration = None
    if cuda:
        ptr, nbytes = host.data_ptr(), flat.numel()
        registration = HostRegistration(ptr, nbytes)
        mapped = mapped_bytes(ptr, nbytes, device)
        if mapped is not None:
            mapped4 = _host4(mapped.view(word), g.layout, N, kvn, L, W)
    elif method == plan.GATHER or method == "auto":
        mapped4 = host4
    return host4, mapped4, registration


def _host4(words: torch.Tensor, layout: str, N: int, kvn: int, L: int, W: int) -> torch.Tensor:
    """The pool as [host page, kv, layer, W] words, whatever the layout (a strided view)."""
    if layout == plan.PAGE_FIRST:
        return words.view(N, kvn, L, W)
    return words.view(kvn, L, N, W).permute(2, 0, 1, 3)


def _fuse(bufw):
    """One [kv, layer, page, W] view over all K/V buffers if they sit on one regular grid.

    True when the loader allocated them; SGLang allocates one tensor per layer,
    and then scatters take one kernel per (kv, layer).
    """
    first = bufw[0][0]
    kvn, L = len(bufw), len(bufw[0])
    storage = first.untyped_storage().data_ptr()
    es = first.element_size()
    if any(b.untyped_storage().data_ptr() != storage for row in bufw for b in row):
        return None
    step_l = bufw[0][1].data_ptr() - first.data_ptr() if L > 1 else 0
    step_kv = bufw[1][0].data_ptr() - first.data_ptr() if kvn > 1 else 0
    if step_l % es or step_kv % es or step_l < 0 or step_kv < 0:
        return None
    for kv in range(kvn):
        for layer in range(L):
            if bufw[kv][layer].data_ptr() - first.data_ptr() != kv * step_kv + layer * step_l:
                return None
    return first.as_strided((kvn, L) + tuple(first.shape), (step_kv // es, step_l // es) +
                            tuple(first.stride()), first.storage_offset())
