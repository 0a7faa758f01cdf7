"""The KV staging path: pages through an engine-owned shared-memory pool, copied to
and from SGLang's host pool.

Owns the path for a KV host pool the workers cannot map (SGLang's default
allocator has no fd; page_first / page_head are token- or head-major, not a
few runs in the canonical file order; pools.zero_copy_plan says why) and for
SGLang's legacy (non-v1) calls, which hand pages as flat tensors. Workers read
into (write from) the staging engine's own pool; a torch copy_ per page (it
releases the GIL) moves each page between a staging slot and SGLang's pool,
counted as `staging_copies`. The slots are lent to one chunk of a batch at a
time (common.Slots), so batches on SGLang's two storage threads share them.
Must not decide which path a pool takes (the backend does).
"""
from __future__ import annotations

import numpy as np
import torch

from shm import gilkeep
from workers import status as st

from ...engine import PrefetchEngine
from ..common import CallStats, Slots, wait_or_abandon
from .layouts import flat_page_view, host_page_view


class StagingPath:
    """An engine with its own shm pool, its free slots, and the copies in and out."""

    def __init__(self, engine: PrefetchEngine, host_pool, is_mla: bool, stats: CallStats,
                 timeout_s: float | None, main: PrefetchEngine | None = None):
        """`host_pool`: SGLang's KV host pool; `timeout_s`: an op past it is
        abandoned (common.waits); `main`: the backend's zero-copy engine, told of
        every page this one writes (legacy calls beside zero-copy), else None."""
        self.engine, self.slots = engine, Slots(engine.config.host_pool_pages)
        self.host_pool, self.is_mla, self.stats = host_pool, is_mla, stats
        self.timeout_s, self.main = timeout_s, main
        self.geometry = engine.geometry

    def _copy(self, dst, src) -> None:
        dst.copy_(src)  # torch releases the GIL for the copy
        self.stats.count("staging_copies")
        self.stats.count("staging_copy_bytes", self.geometry.page_bytes)

    def _through(self, keys, *, write: bool, fill=None, take_out=None,
                 stop_short: bool = False) -> np.ndarray:
        """Move `keys` through the staging engine in chunks of free slots.

        `fill(start, slots)` puts pages into the slots before a write;
        `take_out(start, slots, op)` copies pages out after a read. Returns one
        bool per key (page ok). With `stop_short`, stops after the first chunk
        whose pages did not all land, since only the leading run counts.
        """
        eng = self.engine
        ok = np.zeros(len(keys), dtype=bool)
        done = 0
        while done < len(keys):
            with self.slots.lent(len(keys) - done) as slots:
                n = len(slots)
                chunk = keys[done:done + n]
                if fill is not None:
                    fill(done, slots)
                op = (eng.backup(chunk, slots) if write else
                      eng.prefetch(chunk, slots, policy="wait_complete"))
                wait_or_abandon(eng, op, self.timeout_s)
                ok[done:done + n] = op.page_status == st.OK
                if take_out is not None:
                    take_out(done, slots, op)
            if write and self.main is not None:
                self.main.mark_present([key for key, good in zip(chunk, ok[done:done + n]) if good])
            done += n
            if stop_short and op.completed_pages < n:
                break
        return ok

    # --- v1: pages by host pool page number ------------------------------------
    def read_pages(self, keys, pages) -> int:
        """Read into staging slots, copy the leading landed pages into SGLang's
        pool; how many leading pages landed."""
        pool = self.engine.host_pool

        def take_out(start, slots, op):
            for j in range(op.completed_pages):
                self._copy(host_page_view(self.host_pool, int(pages[start + j]), self.is_mla),
                           pool.page_view(slots[j]))

        return gilkeep.first_false(self._through(keys, write=False, take_out=take_out,
                                                 stop_short=True))

    def write_pages(self, keys, pages) -> np.ndarray:
        """Copy the pages into staging slots and write them; ok per key."""
        pool = self.engine.host_pool

        def fill(start, slots):
            for j, slot in enumerate(slots):
                self._copy(pool.page_view(slot),
                           host_page_view(self.host_pool, int(pages[start + j]), self.is_mla))

        return self._through(keys, write=True, fill=fill)

    # --- legacy: pages as flat tensors in the host layout's page order ----------
    def read_flat(self, keys, target_locations=None) -> list:
        """Each key's page as a flat tensor (into its target location where given)
        in the host layout's page order (SGLang's get_dummy_flat_data_page /
        set_from_flat_data_page convention); None: a miss."""
        pool, g, layout = self.engine.host_pool, self.geometry, self.host_pool.layout
        out = [None] * len(keys)

        def take_out(start, slots, op):
            for j in np.flatnonzero(op.page_status == st.OK).tolist():
                i = start + j
                if target_locations is not None and target_locations[i] is not None:
                    target = target_locations[i]
                else:
                    target = torch.empty(g.page_bytes // g.itemsize, dtype=getattr(torch, g.dtype))
                self._copy(flat_page_view(target, layout, g), pool.page_view(slots[j]))
                out[i] = target

        self._through(keys, write=False, take_out=take_out)
        return out

    def write_flat(self, keys, values) -> bool:
        """Write one flat page tensor per key; True when every page is stored."""
        pool, g, layout = self.engine.host_pool, self.geometry, self.host_pool.layout

        def fill(start, slots):
            for j, slot in enumerate(slots):
                flat = values[start + j].contiguous().view(-1)
                if flat.numel() * flat.element_size() != g.page_bytes:
                    raise ValueError(f"hicache_mp: a page holds {g.page_bytes} bytes, got "
                                     f"{flat.numel() * flat.element_size()}")
                self._copy(pool.page_view(slot), flat_page_view(flat, layout, g))

        return bool(self._through(keys, write=True, fill=fill).all())
