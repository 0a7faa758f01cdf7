"""Deterministic page contents: what the warm-up and backups write, and the check.

Owns the byte pattern of a page for a key: a seeded base pattern with the
key's sha256 stamped every 4 KiB, so two keys never share a page image and a
misplaced, stale or torn page fails `matches`. Filling and checking go through
the host pool's logical page view, so they hold for both layouts. Must not
start I/O: the caller hands the filled slots to the engine.
"""
from __future__ import annotations

import hashlib

import numpy as np

STAMP_EVERY = 4096


class PageBytes:
    def __init__(self, geometry, seed: int = 0):
        import torch  # scheduler side only
        self._torch = torch
        self.geometry = geometry
        self._dtype = getattr(torch, geometry.dtype)
        n = geometry.page_bytes
        self._base = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        starts = np.arange(0, max(1, n - 31), STAMP_EVERY)
        self._stamp_at = (starts[:, None] + np.arange(32)).ravel()

    def expected(self, key: str) -> np.ndarray:
        """The page image for `key`, in canonical (logical) byte order."""
        page = self._base.copy()
        digest = np.frombuffer(hashlib.sha256(key.encode()).digest(), dtype=np.uint8)
        page[self._stamp_at] = np.resize(digest, self._stamp_at.size)
        return page

    def _as_page(self, image: np.ndarray):
        t = self._torch.from_numpy(image)
        return t.view(self._dtype).view(self.geometry.page_shape)

    def fill(self, host_pool, slot: int, key: str) -> None:
        # copy_ is a byte copy for equal dtypes, so NaN bit patterns survive.
        host_pool.page_view(slot).copy_(self._as_page(self.expected(key)))

    def stamp(self, host_pool, slot: int, key: str) -> None:
        """Mark a slot as `key`'s page in O(1): its first bytes become the key's digest.

        For write-backs inside the scheduler loop. A GPU writes that KV with an
        async D2H copy that costs the scheduler nothing; a full `fill` (a page
        copy, 8 MiB at full scale) there would stall the loop and bias the run.
        """
        n = min(self.geometry.head_dim, 32 // self.geometry.itemsize)
        digest = self._torch.frombuffer(bytearray(hashlib.sha256(key.encode()).digest()),
                                        dtype=self._torch.uint8)
        host_pool.page_view(slot)[0, 0, 0, 0, :n].copy_(
            digest[:n * self.geometry.itemsize].view(self._dtype))

    def matches_part(self, host_pool, slot: int, key: str, part: int, parts: int) -> bool:
        """A slot of a layer-parts pool (decision 101) holds layer group `part`
        of `parts` of `key`'s page: [kv][the group's layers][...]."""
        g = self.geometry
        want = self.expected(key).reshape(g.kv_count, g.num_layers, -1)
        layers = g.num_layers // parts
        want = want[:, part * layers:(part + 1) * layers]
        got = host_pool.page_view(slot).contiguous().view(-1).view(self._torch.uint8).numpy()
        return bool(np.array_equal(got, want.ravel()))

    def matches(self, host_pool, slot: int, key: str) -> bool:
        got = host_pool.page_view(slot).contiguous().view(-1).view(self._torch.uint8).numpy()
        return bool(np.array_equal(got, self.expected(key)))
