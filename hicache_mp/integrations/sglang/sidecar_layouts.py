"""Byte layout of SGLang's sidecar host pools (Mamba, SWA, DSA indexer, DeepSeek V4...).

Owns one thing: where the bytes of a sidecar page live in an SGLang host pool,
so a whole batch of pages moves between that pool and a flat `[n, page_bytes]`
uint8 tensor with a few torch ops (no Python loop over pages). The page's byte
order is SGLang's own flat page (`get_data_page(index, flat=True)` viewed as
bytes), the order SGLang's `file` backend stores. Must not do I/O or start
anything.

A page is a list of components; each is a slice of one host tensor along one
dim: `tensor.narrow(dim, index // div, length)` for the page at host index
`index` (SGLang 0.5.23, `mem_cache/pool_host/`):

    pool (layout)                        tensor                      dim  div  length
    Mamba (page_first[_direct])          temporal_buffer, conv_buffer[i],
                                         slot_state_buffers[i]        0    1    1
    DSA indexer (page_first[_direct])    index_k_with_scale_buffer    0    P    1
    DSA indexer (layer_first)            index_k_with_scale_buffer    1    P    1
    MHA-like, SWA (layer_first)          kv_buffer (2,L,size,H,D)     2    1    P
    MHA-like (page_first)                kv_buffer (2,size,L,H,D)     1    1    P
    MHA-like (page_first_direct|head)    kv_buffer (2,pages,...)      1    P    1
    MLA-like (layer_first)               kv_buffer (L,size,1,d)       1    1    P
    MLA-like (page_first)                kv_buffer (size,L,1,d)       0    1    P
    MLA-like (page_first_direct)         kv_buffer (pages,L,P,1,d)    0    P    1

A pool that fits none of these (or whose plan disagrees with its own
get_data_page size) is moved page by page through its own
get_data_page / set_from_flat_data_page, as SGLang's `file` backend does.

`zero_copy_parts()` says when the workers can read straight into the pool:
every component a contiguous tensor that is the whole of one of the shm
allocator's memfds (every layout in the table above, under "allocator":
"shm"). The workers then map every memfd and a page is a few runs of them
(shm.partpool: one per tensor for a Mamba state, K and V for a (2, pages,
...) tensor, one per K/V and layer for layer_first); the scheduler's process
makes no torch call per component or page.
"""
from __future__ import annotations

import os

from dataclasses import dataclass

import torch

from .pools import buffer_address


@dataclass(frozen=True)
class Component:
    tensor: torch.Tensor   # a uint8 view of the host tensor (same memory)
    dim: int
    div: int
    length: int

    @property
    def page_bytes(self) -> int:
        rest = self.tensor.numel() // self.tensor.shape[self.dim] if self.tensor.numel() else 0
        return rest * self.length


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _can_pin() -> bool:
    """Is there an accelerator whose allocator pins host memory?"""
    try:
        acc = getattr(torch, "accelerator", None)
        if acc is not None:
            return bool(acc.is_available())
        return bool(torch.cuda.is_available())
    except Exception:
        return False


class _Unpinned:
    """A host pool seen with pin_memory=False, for SGLang's own page helpers.

    SGLang 0.5.23's `get_dummy_flat_data_page` allocates with the pool's
    `pin_memory` (True by default, as its servers build every host pool), and
    torch without an accelerator refuses pinned memory outright. The helper
    reads only attributes, so it runs against this view of the pool, which
    changes nothing on the pool itself (SGLang's threads may be reading it).
    """

    def __init__(self, pool):
        object.__setattr__(self, "_pool", pool)

    def __getattr__(self, name):
        if name == "pin_memory":
            return False
        return getattr(self._pool, name)


def dummy_flat_page(host_pool) -> torch.Tensor:
    """host_pool.get_dummy_flat_data_page(), unpinned where nothing can pin."""
    if getattr(host_pool, "pin_memory", False) and not _can_pin():
        fn = getattr(type(host_pool), "get_dummy_flat_data_page", None)
        if fn is not None:
            return fn(_Unpinned(host_pool))
    return host_pool.get_dummy_flat_data_page()


class BatchLayout:
    """Pages as slices of a few host tensors: batched gather / scatter."""

    batched = True

    def __init__(self, components: list[Component], kind: str):
        self.components = [c for c in components if c.tensor.numel()]
        self.kind = kind
        self.page_bytes = sum(c.page_bytes for c in self.components)

    @property
    def kv_runs(self) -> int:
        """2 where a page is a K run and a V run of a (2, pages, ...) tensor, else 1."""
        if len(self.components) == 1:
            c = self.components[0]
            if c.dim == 1 and c.length == 1 and c.tensor.shape[0] == 2:
                return 2
        return 1

    def describe(self) -> str:
        parts = [f"{tuple(c.tensor.shape)}@{c.dim}/{c.div}x{c.length}" for c in self.components]
        return f"{self.kind}:{self.page_bytes}:" + ",".join(parts)

    def _rows(self, c: Component, index: torch.Tensor) -> torch.Tensor:
        start = index // c.div
        if c.length == 1:
            return start
        return (start[:, None] + torch.arange(c.length)).reshape(-1)

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] = the bytes of the page at host index index[i]."""
        n, off = len(index), 0
        for c in self.components:
            sel = c.tensor.index_select(c.dim, self._rows(c, index))
            shape = list(sel.shape)
            sel = sel.reshape(shape[:c.dim] + [n, c.length] + shape[c.dim + 1:])
            sel = sel.movedim(c.dim, 0).reshape(n, -1)
            out[:, off:off + c.page_bytes].copy_(sel)
            off += c.page_bytes

    def scatter(self, index: torch.Tensor, data: torch.Tensor) -> None:
        """The page at host index index[i] = data[i]."""
        n, off = len(index), 0
        for c in self.components:
            shape = list(c.tensor.shape)
            page_shape = shape[:c.dim] + [c.length] + shape[c.dim + 1:]
            chunk = data[:, off:off + c.page_bytes].reshape([n] + page_shape)
            chunk = chunk.movedim(0, c.dim)
            chunk = chunk.reshape(shape[:c.dim] + [n * c.length] + shape[c.dim + 1:])
            c.tensor.index_copy_(c.dim, self._rows(c, index), chunk)
            off += c.page_bytes


class PerPageLayout:
    """Any other pool: its own get_data_page / set_from_flat_data_page, page by page."""

    batched = False
    kv_runs = 1

    def __init__(self, host_pool, page_bytes: int, kind: str):
        self.pool, self.page_bytes, self.kind = host_pool, page_bytes, kind

    def describe(self) -> str:
        return f"{self.kind}:{self.page_bytes}:per-page"

    def gather(self, index: torch.Tensor, out: torch.Tensor) -> None:
        for i, idx in enumerate(index.tolist()):
            out[i].copy_(_u8(self.pool.get_data_page(idx, flat=True).contiguous()).reshape(-1))

    def scatter(self, index: torch.Tensor, data: torch.Tensor) -> None:
        dummy = dummy_flat_page(self.pool)
        for i, idx in enumerate(index.tolist()):
            self.pool.set_from_flat_data_page(idx, data[i].view(dummy.dtype))


_KV_TABLE = {  # (mla, layout) -> (dim, by_page)
    (False, "layer_first"): (2, False), (False, "page_first"): (1, False),
    (False, "page_first_direct"): (1, True), (False, "page_head"): (1, True),
    (True, "layer_first"): (1, False), (True, "page_first"): (0, False),
    (True, "page_first_direct"): (0, True),
}


def _components(pool) -> tuple[list[Component], str] | None:
    P = int(getattr(pool, "page_size", 1) or 1)
    layout = getattr(pool, "layout", None)
    temporal = getattr(pool, "temporal_buffer", None)
    if temporal is not None and layout in ("page_first", "page_first_direct"):
        tensors = [temporal, *getattr(pool, "conv_buffer", ()),
                   *getattr(pool, "slot_state_buffers", ())]
        return [Component(_u8(t), 0, 1, 1) for t in tensors], "mamba"
    index_buf = getattr(pool, "index_k_with_scale_buffer", None)
    if index_buf is not None and layout in ("page_first", "page_first_direct", "layer_first"):
        dim = 1 if layout == "layer_first" else 0
        return [Component(_u8(index_buf), dim, P, 1)], "indexer"
    kv = getattr(pool, "kv_buffer", None)
    if isinstance(kv, torch.Tensor) and int(getattr(pool, "dcp_size", 1) or 1) == 1:
        mla = not hasattr(pool, "head_num")
        entry = _KV_TABLE.get((mla, layout))
        if entry is not None:
            dim, by_page = entry
            return [Component(_u8(kv), dim, P if by_page else 1, 1 if by_page else P)], \
                "mla" if mla else "mha"
    return None


def plan(host_pool):
    """The layout of `host_pool`'s pages (batched where known, else page by page).

    Raises ValueError for an object that is no SGLang host pool at all (it has
    neither a known buffer layout nor get_data_page/set_from_flat_data_page).
    """
    flat = None
    if hasattr(host_pool, "get_dummy_flat_data_page"):
        d = dummy_flat_page(host_pool)
        flat = d.numel() * d.element_size()
    found = _components(host_pool)
    if found is not None:
        layout = BatchLayout(*found)
        if flat is None or flat == layout.page_bytes:
            return layout
    if flat is not None and hasattr(host_pool, "set_from_flat_data_page") \
            and hasattr(host_pool, "get_data_page"):
        return PerPageLayout(host_pool, flat, type(host_pool).__name__)
    raise ValueError(f"hicache_mp: {type(host_pool).__name__} is not an SGLang host pool "
                     f"this backend can read (no known buffer layout and no "
                     f"get_data_page/set_from_flat_data_page)")


# iovecs one page may take: preadv/pwritev take IOV_MAX (1024) with the page
# file's header and overflow guard; a layout needing more is staged.
MAX_PARTS = 512


def zero_copy_parts(host_pool, layout) -> tuple[list | None, int, str]:
    """([(memfd, offset, stride) per part], pages, "") where workers can map the
    pool's page tensors and read a page as runs of them (shm.partpool), else
    (None, 0, why not).

    Every component must be a contiguous tensor that is the whole of one of
    the shm allocator's memfds (matched by base address: the allocator keeps
    one fd per tensor, in allocation order, and a pool may skip empty ones),
    and its page slice must be `length` rows starting at row page * length
    (page_size == div * length). The page is then, for each index over the
    dims before `dim`, one run of `length` rows: one part each (a Mamba
    tensor or a page-major pool: one; a (2, pages, ...) K/V tensor: two; a
    layer_first pool: one per K/V and layer). The parts follow the
    components and `gather`'s order, which is SGLang's flat page, so a file
    written either way reads the other.
    """
    if not isinstance(layout, BatchLayout) or not layout.components:
        return None, 0, "an unknown layout (moved page by page)"
    P = int(getattr(host_pool, "page_size", 1) or 1)
    alloc = getattr(host_pool, "allocator", None)
    fds, mms = list(getattr(alloc, "fds", None) or []), list(getattr(alloc, "mms", None) or [])
    by_base = {}
    for fd, mm in zip(fds, mms):
        base = buffer_address(mm)
        if base is not None and fd is not None:
            by_base[base] = fd
    parts, pages = [], None
    for c in layout.components:
        if c.div * c.length != P or not c.tensor.is_contiguous():
            return None, 0, "its pages are not whole rows of contiguous tensors"
        rows = int(c.tensor.shape[c.dim])
        n = rows // c.length
        if pages not in (None, n):
            return None, 0, "its tensors hold different numbers of pages"
        pages = n
        fd = by_base.get(c.tensor.data_ptr())
        if fd is None:
            return None, 0, "the pool has no memfd (SGLang's default allocator)"
        if os.fstat(fd).st_size < c.tensor.numel():
            return None, 0, "its memfd is smaller than the pool"
        outer = 1
        for size in c.tensor.shape[:c.dim]:
            outer *= int(size)
        row = c.tensor.numel() // (outer * rows)       # bytes: the view is uint8
        if len(parts) + outer > MAX_PARTS:
            return None, 0, f"a page is more than {MAX_PARTS} runs"
        parts += [(fd, i * rows * row, c.length * row) for i in range(outer)]
    if not pages:
        return None, 0, "the pool holds no whole page"
    return parts, pages, ""
