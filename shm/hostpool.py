"""The host pool: KV pages in one shared-memory segment, and views of them.

Owns the mapping of the pool and the views both sides use: torch views for
the scheduler (`tensor`, `page_view`), byte iovecs for workers (`page_iovecs`).
torch is imported lazily, on the scheduler side only. Must not do I/O.
"""
from .geometry import PageGeometry
from .segment import Segment, check_room


class HostPool:
    def __init__(self, geometry: PageGeometry, num_pages: int, *, name: str, create: bool,
                 populate: bool = True, fd: int | None = None):
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"host pool needs a positive page count, got {num_pages!r}")
        self.geometry = geometry
        self.num_pages = num_pages
        if create and fd is None:
            check_room(geometry.pool_bytes(num_pages), "the host pool")
        self.segment = Segment(name, geometry.pool_bytes(num_pages), create=create,
                               populate=populate, fd=fd)
        self._mv = memoryview(self.segment.map)
        self._tensor = None

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def nbytes(self) -> int:
        return self.segment.size

    # --- scheduler side (torch) ---------------------------------------------
    @property
    def tensor(self):
        """The whole pool as a torch tensor shaped by the layout (no copy)."""
        if self._tensor is None:
            import torch  # lazily: workers never get here
            dtype = getattr(torch, self.geometry.dtype)
            flat = torch.frombuffer(self.segment.map, dtype=torch.uint8)
            self._tensor = flat.view(dtype).view(self.geometry.pool_shape(self.num_pages))
        return self._tensor

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
        return [self._mv[off:off + length] for off, length in self.geometry.page_runs(page, self.num_pages)]

    def check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"host page {page} out of range [0, {self.num_pages})")

    def close(self) -> None:
        self._tensor = None
        self._mv.release()
        self.segment.close()

