"""The host pool: KV pages in one shared-memory segment, and views of them.

Owns the mapping of the pool and the views both sides use: torch views for
the scheduler (`tensor`, `page_view`), byte iovecs for workers (`page_iovecs`).
torch is imported lazily, on the scheduler side only. Must not do I/O.

Once closed, every way into the bytes (`segment`, `tensor`, `page_view`,
`page_iovecs`) raises `closed_error` (PoolClosed unless the owner names its
own, as the engine does with EngineClosed), never the mmap's "closed or
invalid". Views taken before the close stay valid: the mapping goes only with
the last of them (shm.segment).
"""
from .geometry import PageGeometry
from .segment import Segment, check_room


class PoolClosed(ValueError):
    """The pool was closed: nothing may read or write its pages any more."""


class HostPool:
    def __init__(self, geometry: PageGeometry, num_pages: int, *, name: str, create: bool,
                 populate: bool = True, fd: int | None = None,
                 closed_error: type[Exception] = PoolClosed):
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"host pool needs a positive page count, got {num_pages!r}")
        self.geometry = geometry
        self.num_pages = num_pages
        self.closed_error = closed_error
        self._closed = False
        if create and fd is None:
            check_room(geometry.pool_bytes(num_pages), "the host pool")
        self._segment = Segment(name, geometry.pool_bytes(num_pages), create=create,
                                populate=populate, fd=fd)
        self._mv = memoryview(self._segment.map)
        self._tensor = None

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def nbytes(self) -> int:
        return self._segment.size

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def segment(self) -> Segment:
        self._check_open()
        return self._segment

    def _check_open(self) -> None:
        if self._closed:
            raise self.closed_error(f"host pool {self.name} is closed")

    # --- scheduler side (torch) ---------------------------------------------
    @property
    def tensor(self):
        """The whole pool as a torch tensor shaped by the layout (no copy)."""
        self._check_open()
        tensor = self._tensor
        if tensor is None:
            import torch  # lazily: workers never get here
            dtype = getattr(torch, self.geometry.dtype)
            flat = torch.frombuffer(self._segment.map, dtype=torch.uint8)
            tensor = self._tensor = flat.view(dtype).view(self.geometry.pool_shape(self.num_pages))
        return tensor

    def page_view(self, page: int):
        """Page `page` as [kv, layer, token, head, dim], whatever the layout.

        A view: writing it writes the pool slot in place.
        """
        self.check_page(page)
        g = self.geometry
        if g.layout == "page_first":
            return self.tensor[page]
        if g.layout == "page_first_direct":  # [kv][page][layer][token]...: SGLang's layout
            return self.tensor[:, page]
        return self.tensor[:, :, page * g.page_size:(page + 1) * g.page_size]

    # --- worker side (bytes) ------------------------------------------------
    def page_iovecs(self, page: int) -> list[memoryview]:
        """Writable byte views of `page` in canonical order, for one preadv/pwritev."""
        self._check_open()
        return [self._mv[off:off + length] for off, length in self.geometry.page_runs(page, self.num_pages)]

    def check_page(self, page: int) -> None:
        self._check_open()
        if not 0 <= page < self.num_pages:
            raise ValueError(f"host page {page} out of range [0, {self.num_pages})")

    def close(self) -> None:
        self._closed = True
        self._tensor = None
        try:
            self._mv.release()
        except BufferError:
            pass  # iovecs still out: the mapping stays until they go; the name goes now
        self._segment.close()

