"""A host pool whose page is one run in each of several regions (file descriptors).

Owns the mappings of such a pool and the byte iovecs workers read into and
write from (`page_iovecs`, as `HostPool` has). It serves SGLang host pools
whose page is several page-major tensors, each its own memfd under the shm
allocator (a Mamba state: temporal, conv and slot-state buffers), and the K
and V halves of one (2, pages, ...) tensor (two parts on one region).

Page `p` is, in part order, the run ``[offset + p * stride, stride)`` of each
part's region; that order is the pool's flat page order, so the page file
holds the same bytes whichever way it was moved. Must not know what the bytes
mean, import torch, or create, resize or unlink a region (their owner does).
Closed, it raises `closed_error` on every way into the bytes, as HostPool does.
"""
import os
from dataclasses import dataclass

from .hostpool import PoolClosed
from .segment import Segment


@dataclass(frozen=True)
class Part:
    fd: int
    offset: int
    stride: int

    def run(self, page: int) -> tuple[int, int]:
        """(offset, length) of `page`'s bytes in this part's region."""
        return self.offset + page * self.stride, self.stride


def check_parts(parts, num_pages: int) -> list[Part]:
    """`parts` as Part objects, or ValueError: every region must hold every page."""
    out = [p if isinstance(p, Part) else Part(*(int(x) for x in p)) for p in parts]
    if not out:
        raise ValueError("a multi-part pool needs at least one part")
    for p in out:
        if p.stride <= 0 or p.offset < 0:
            raise ValueError(f"pool part {p}: stride must be positive and offset >= 0")
    for fd, need in region_sizes(out, num_pages).items():
        have = os.fstat(fd).st_size
        if have < need:
            raise ValueError(f"pool part region (fd {fd}) holds {have} bytes; its parts need "
                             f"{need} for {num_pages} pages")
    return out


def region_sizes(parts, num_pages: int) -> dict[int, int]:
    """Bytes each region must hold from offset 0, by fd."""
    need: dict[int, int] = {}
    for p in parts:
        need[p.fd] = max(need.get(p.fd, 0), p.offset + num_pages * p.stride)
    return need


class PartPool:
    def __init__(self, parts, num_pages: int, *, name: str, populate: bool = True,
                 closed_error: type[Exception] = PoolClosed):
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"host pool needs a positive page count, got {num_pages!r}")
        self.parts = check_parts(parts, num_pages)
        self.num_pages = num_pages
        self.name = name
        self.closed_error = closed_error
        self._closed = False
        self._segments, self._views = [], {}
        try:
            for i, (fd, size) in enumerate(region_sizes(self.parts, num_pages).items()):
                seg = Segment(f"{name}.{i}", size, create=False, populate=populate, fd=fd)
                self._segments.append(seg)
                self._views[fd] = memoryview(seg.map)
        except BaseException:
            self.close()
            raise
        self._runs = [(self._views[p.fd], p.offset, p.stride) for p in self.parts]

    @property
    def page_bytes(self) -> int:
        return sum(p.stride for p in self.parts)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def page_runs(self, page: int) -> list[tuple[int, int]]:
        """(offset, length) per part, each in its own region (alignment checks)."""
        return [p.run(page) for p in self.parts]

    def page_iovecs(self, page: int) -> list[memoryview]:
        """Writable byte views of `page`, part by part, for one preadv/pwritev."""
        if self._closed:
            raise self.closed_error(f"host pool {self.name} is closed")
        return [mv[off + page * stride:off + (page + 1) * stride]
                for mv, off, stride in self._runs]

    @property
    def closed(self) -> bool:
        return self._closed

    def check_page(self, page: int) -> None:
        if self._closed:
            raise self.closed_error(f"host pool {self.name} is closed")
        if not 0 <= page < self.num_pages:
            raise ValueError(f"host page {page} out of range [0, {self.num_pages})")

    def close(self) -> None:
        self._closed = True
        self._runs = []
        for mv in self._views.values():
            try:
                mv.release()
            except BufferError:
                pass  # iovecs still out: that mapping stays until they go
        self._views = {}
        for seg in self._segments:
            seg.close()
        self._segments = []
