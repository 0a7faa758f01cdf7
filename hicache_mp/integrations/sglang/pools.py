"""SGLang's KV host pool as the engine sees it: its page geometry, and whether the
engine's workers can move pages straight into it (zero copy).

Owns reading an SGLang host pool (0.5.23 `mem_cache/pool_host/`, MHA or MLA):
the hicache_mp `PageGeometry` of its pages, and the zero-copy plan, checked
against SGLang's own get_page_buffer_meta() so offsets are never guessed.
Must not start an engine or move page bytes.

    zero-copy  ("allocator":"shm", layout layer_first or page_first_direct)
        SGLang's host pool is a memfd. The engine dups its fd and hands it to
        every worker, which maps it and preadv/pwritev's page files straight
        into/out of SGLang's pool slots.

    staging    (anything else: the default allocator has no fd; SGLang's
        page_first / page_head layouts are token- or head-major, not a few
        runs in the canonical [kv][layer][token][head][dim] file order)
        See `staging`.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from shm import PageGeometry

ZERO_COPY_LAYOUTS = ("layer_first", "page_first_direct")
HOW_TO_ZERO_COPY = ('For zero-copy start SGLang with "allocator":"shm" in '
                    '--hicache-storage-backend-extra-config (SGLang >= 0.5.17) and '
                    '--hicache-mem-layout layer_first or page_first_direct')


def buffer_address(buf) -> int | None:
    """The first byte's address of a buffer (an mmap of SGLang's shm allocator),
    or None where it exposes none."""
    try:
        return int(np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data)
    except Exception:
        return None


def pool_geometry(host_pool, is_mla: bool, layout: str = "page_first") -> PageGeometry:
    """The hicache_mp geometry of an SGLang host pool's pages (MHA or MLA)."""
    dtype = str(host_pool.dtype).removeprefix("torch.")
    # The pool's class decides the page shape (MLA pools have kv_cache_dim and no
    # head_num); the storage config's is_mla_model decides only the namespace.
    if is_mla and not hasattr(host_pool, "head_num"):
        dim = getattr(host_pool, "kv_cache_dim", None)
        if dim is None:
            dim = host_pool.kv_lora_rank + host_pool.qk_rope_head_dim
        return PageGeometry(num_layers=int(host_pool.layer_num), num_kv_heads=1, head_dim=int(dim),
                            page_size=int(host_pool.page_size), dtype=dtype, layout=layout, mla=True)
    return PageGeometry(num_layers=int(host_pool.layer_num), num_kv_heads=int(host_pool.head_num),
                        head_dim=int(host_pool.head_dim), page_size=int(host_pool.page_size),
                        dtype=dtype, layout=layout)


def zero_copy_plan(host_pool, is_mla: bool) -> tuple[PageGeometry | None, str]:
    """(geometry whose page runs are SGLang's, "") or (None, why not).

    The runs come from SGLang's own get_page_buffer_meta(): pointer minus the
    pool base, reordered from SGLang's order (MHA: per layer K, V) into the
    canonical one (all K layers, then all V layers), and must equal the
    geometry's runs for the first, second and last page.
    """
    fd = getattr(host_pool, "fd", None)
    if fd is None:
        return None, "the host pool has no file descriptor (SGLang's default allocator)"
    layout = getattr(host_pool, "layout", None)
    if layout not in ZERO_COPY_LAYOUTS:
        return None, (f"host layout {layout!r} is not a few runs in canonical page order "
                      f"(zero-copy layouts: {', '.join(ZERO_COPY_LAYOUTS)})")
    try:
        g = pool_geometry(host_pool, is_mla, layout)
        num_pages = int(host_pool.page_num)
        base = int(host_pool.kv_buffer.data_ptr())
        mms = getattr(getattr(host_pool, "allocator", None), "mms", None) or []
        if mms:  # the fd's mapping must start where the pool starts
            start = buffer_address(mms[0])
            if start is not None and start != base:
                return None, f"the host pool starts {base - start} bytes into its memfd"
        size = os.fstat(fd).st_size
        if size < g.pool_bytes(num_pages):
            return None, f"the memfd holds {size} bytes, the pool needs {g.pool_bytes(num_pages)}"
        P = g.page_size
        for page in sorted({0, min(1, num_pages - 1), num_pages - 1}):
            ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(page * P, (page + 1) * P))
            runs = [(int(p) - base, int(s)) for p, s in zip(ptrs, sizes)]
            if g.kv_count == 2:
                runs = runs[0::2] + runs[1::2]
            if runs != g.page_runs(page, num_pages):
                return None, (f"SGLang's page-buffer metadata for page {page} does not match "
                              f"the {layout} geometry")
    except Exception as exc:  # an unfamiliar pool: never guess offsets
        return None, f"cannot read the host pool's page-buffer metadata ({exc!r})"
    return g, ""
