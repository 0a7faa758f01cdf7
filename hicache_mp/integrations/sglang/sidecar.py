"""One sidecar pool of SGLang's v2 interface: its engine, staging slots and page moves.

Owns what moves the pages of one registered sidecar pool (Mamba state, SWA
window, DSA indexer, ...) between SGLang's host pool and its engine:
`SidecarPool.start` submits a zero-copy batch without waiting (the caller,
hybrid.HybridPools.io, waits once for every op of a batch), and
`read` / `write` move a staged batch through the engine's shared-memory
staging slots with a few batched torch copies (`sidecar_layouts`). Must not
decide hits (`hits` does) or touch the KV pool's engine.

Everything here that runs per batch on SGLang's storage threads keeps the
GIL (shm.gilkeep's rules): index conversions and status checks in chunks
of gilkeep.CHUNK, presence as bytes, no ufunc.at, sort or unique. The staged
path's torch copies are the exception: every torch op lets the GIL go.
"""
from __future__ import annotations

import numpy as np
import torch

from shm import gilkeep
from workers import status as st

from ...engine import PrefetchEngine
from ..common import Slots, leading, wait_or_abandon


class SidecarPool:
    """One registered sidecar pool: its layout, engine and staging slots."""

    def __init__(self, name: str, host_pool, layout, engine: PrefetchEngine, zero_copy: bool,
                 probe_wait_s: float = 0.0, parts: int = 0):
        self.probe_wait_s = probe_wait_s
        self.name, self.host_pool, self.layout, self.engine = name, host_pool, layout, engine
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        self.zero_copy = zero_copy
        self.parts = parts          # runs per page in the mapped memfds (zero-copy)
        pages = engine.config.host_pool_pages
        self.staging = None if zero_copy else \
            engine.host_pool.tensor.view(torch.uint8).reshape(pages, layout.page_bytes)
        self.slots = None if zero_copy else Slots(pages, keep_sorted=True)

    def key(self, key: str) -> str:
        return f"{key}.{self.name}"

    def present(self, keys, ask: bool = True, wait: bool = True) -> np.ndarray:
        """Per key: its page is in the store. Keys the index misses are asked of
        the workers, as for KV (hicache_mp.engine.discovery): another process sharing
        the directory may have written them, and no stat runs in this process.
        With `wait` False the answers already in are applied and none is
        waited for (a later call sees the rest)."""
        eng = self.engine
        skeys = [f"{k}.{self.name}" for k in keys]
        if not wait:
            eng.poll()  # answers to an earlier ask(): GIL kept, no sleep
        out = eng.present(skeys)
        if ask and 0 in out.tobytes():
            eng.ask(skeys, wait_s=self.probe_wait_s if wait else 0.0)
            out = eng.present(skeys)
        return out

    def ask(self, keys) -> None:
        """Ask the store about the keys the index misses; wait for nothing."""
        self.engine.ask([f"{k}.{self.name}" for k in keys], wait_s=0.0)

    def start(self, keys, pages: np.ndarray, write: bool):
        """Zero-copy: submit the batch's one op, waiting for nothing.
        (engine, op or None, answer()): answer() after the op is done."""
        eng, n = self.engine, len(keys)
        if not write:
            op = eng.prefetch([f"{k}.{self.name}" for k in keys], pages, policy="wait_complete")
            return eng, op, lambda: leading(op.completed_pages, n)
        # what the index knows is stored is not written again; no ask (a write
        # of a page another process wrote is the same bytes, an ask a sleep)
        ok = self.present(keys, ask=False)
        if 0 not in ok.tobytes():
            return eng, None, lambda: [True] * n
        todo = gilkeep.where(ok, False)
        op = eng.backup([f"{keys[i]}.{self.name}" for i in todo.tolist()],
                        gilkeep.take(pages, todo))

        def answer():
            gilkeep.set_at(ok, todo, gilkeep.eq(op.page_status, st.OK))
            return ok.tolist()
        return eng, op, answer

    def _stage(self, slots: list[int]):
        s0 = slots[0]
        if slots == list(range(s0, s0 + len(slots))):
            return self.staging[s0:s0 + len(slots)], None
        return torch.empty(len(slots), self.layout.page_bytes, dtype=torch.uint8), \
            torch.tensor(slots, dtype=torch.int64)

    def read(self, keys, index: np.ndarray, timeout_s: float | None) -> list[bool]:
        """Read pages into the host pool; only the leading run of landed pages counts.
        `index`: each page's first host index (numpy int64); an op past
        `timeout_s` is abandoned (common.waits)."""
        index = torch.from_numpy(index)
        done = 0
        while done < len(keys):
            with self.slots.lent(len(keys) - done) as slots:
                n = len(slots)
                op = self.engine.prefetch([self.key(k) for k in keys[done:done + n]], slots,
                                          policy="wait_complete")
                wait_or_abandon(self.engine, op, timeout_s)
                ok = int(op.completed_pages)
                if ok:
                    src = self.staging[torch.tensor(slots[:ok], dtype=torch.int64)]
                    self.layout.scatter(index[done:done + ok], src)
            done += ok
            if ok < n:
                break
        return leading(done, len(keys))

    def write(self, keys, index: np.ndarray, timeout_s: float | None) -> list[bool]:
        """Write pages not yet stored; per key whether its page is in the store."""
        ok = self.present(keys, ask=False)
        todo = gilkeep.where(ok, False)
        index = torch.from_numpy(index)
        pos = 0
        while pos < len(todo):
            with self.slots.lent(len(todo) - pos) as slots:
                part = todo[pos:pos + len(slots)]
                buf, rows = self._stage(slots)
                self.layout.gather(index[torch.from_numpy(part)], buf)
                if rows is not None:
                    self.staging.index_copy_(0, rows, buf)
                op = self.engine.backup([self.key(keys[i]) for i in part], slots)
                wait_or_abandon(self.engine, op, timeout_s)
                ok[part] = op.page_status == st.OK
            pos += len(part)
        return ok.tolist()

    def close(self) -> None:
        self.staging = None
        self.engine.close()
