"""Handles for DeviceLoader work: what a caller holds for one load or one store.

Owns per-handle progress (pages issued, pages loaded, per-layer events, the
backup op a store feeds). Must not issue copies: `DeviceLoader.step()` does,
and these objects only record and answer.
"""
import collections
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workers.timing import BACKOFF_S, DEVICE_WAIT_SLICE_S

from ..engine.ops import Op
from .cuda import DONE


class LoadHandle:
    """Pages of one op (or of resident host slots) on their way to device pages.

    - `issued`: leading pages whose copies are queued on the load stream;
    - `pages_loaded`: leading pages whose copies have finished on the device;
    - `layer_event(l)`: covers layer `l` of every page issued so far, so a
      forward pass waits per layer instead of for the whole op;
    - `done`: the op is finished, all its landed pages are on the device, and
      the host slots may be reused.
    """

    def __init__(self, loader, op, host_pages, device_pages, ready_event):
        self.loader = loader
        self.op = op
        self.host_pages = host_pages
        self.device_pages = device_pages
        self.num_pages = len(device_pages)
        self.issued = 0
        self.min_step_pages = 1
        self._ready = ready_event          # the caller's stream, when load() was called
        self._layer_events = [DONE] * loader.geometry.num_layers
        self._pending = collections.deque()  # (pages issued up to, event), in issue order
        self._loaded = 0
        self.batches = []                  # (start, end, issue_ns, start_event, end_event) with timing

    # --- progress -----------------------------------------------------------
    @property
    def available(self) -> int:
        """Leading pages whose bytes are in the host pool."""
        return self.num_pages if self.op is None else self.op.completed_pages

    @property
    def source_done(self) -> bool:
        return self.op is None or self.op.done

    @property
    def all_issued(self) -> bool:
        return self.source_done and self.issued == self.available

    @property
    def pages_loaded(self) -> int:
        pending = self._pending
        while pending and pending[0][1].query():
            self._loaded = pending.popleft()[0]
        return self._loaded

    @property
    def done(self) -> bool:
        return self.all_issued and self.pages_loaded == self.issued

    @property
    def status(self) -> str:
        if not self.done:
            return "loading"
        return "ok" if self.op is None else self.op.status

    # --- events -------------------------------------------------------------
    def layer_event(self, layer: int):
        return self._layer_events[layer]

    @property
    def event(self):
        """Covers every layer of every page issued so far."""
        return self._pending[-1][1] if self._pending else DONE

    def wait_layer(self, layer: int, stream=None) -> None:
        """Make `stream` (default: the current one) wait for layer `layer`, without blocking the host."""
        self.loader.stream_wait(self._layer_events[layer], stream)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until `done` (driving the engine and the loader meanwhile)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        loader = self.loader
        while True:
            loader.step()
            if self.done:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if self.all_issued:
                self.event.synchronize()
            elif loader.engine is not None:
                loader.engine.wait(self.op, DEVICE_WAIT_SLICE_S)  # load pages as they land
            else:
                time.sleep(BACKOFF_S)  # someone else polls the engine

    # --- the loader's calls (hicache_mp.device) ------------------------------
    def take_ready(self):
        """The caller's stream event to wait on before the first copy, once
        (None after: later batches follow on the load stream)."""
        ready, self._ready = self._ready, None
        return ready

    def issued_batch(self, end: int, event, layer_events) -> None:
        """Pages up to `end` are issued; `event` covers them, `layer_events` per layer."""
        self.issued = end
        self._pending.append((end, event))
        self._layer_events = layer_events

    def __repr__(self) -> str:
        return (f"LoadHandle(op={getattr(self.op, 'id', None)}, pages={self.num_pages}, "
                f"issued={self.issued}, status={self.status})")


@dataclass(eq=False)
class StoreHandle:
    """Device pages being copied into host slots; with keys, then backed up.

    `copied`: the host slots hold the bytes. `backup_op`: the engine op that
    writes them to the store, submitted by `DeviceLoader.step()` once copied.
    `done`: copied, and backed up if keys were given.
    """

    loader: Any                    # the DeviceLoader (hicache_mp.device)
    event: Any                     # recorded after the copies: a torch.cuda.Event, or DONE
    host_pages: np.ndarray
    device_pages: np.ndarray
    keys: list | None
    backup_op: Op | None = field(default=None, init=False)
    error: BaseException | None = field(default=None, init=False)

    @property
    def copied(self) -> bool:
        return self.event.query()

    @property
    def done(self) -> bool:
        if self.error is not None:
            return True
        if self.keys is None:
            return self.copied
        return self.backup_op is not None and self.backup_op.done

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if not self.done:
            return "storing"
        return "ok" if self.backup_op is None else self.backup_op.status

    def wait(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.event.synchronize()
        self.loader.step()
        if self.error is not None:
            raise self.error
        if self.backup_op is None:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.loader.engine.wait(self.backup_op, left)

    def __repr__(self) -> str:
        return f"StoreHandle(pages={len(self.host_pages)}, status={self.status})"
