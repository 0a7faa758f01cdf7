"""Copies for the DeviceLoader: the DMA copies and kernels of one batch, in either direction.

Owns turning a batch of (host page, device page) pairs into work queued on a
stream: merged DMA copies, zero-copy gathers through the pool's device
mapping, the scatter into the K/V buffers, layer_first's direct per-plane
copies, the staging buffers, and the events that mark a layer or a batch.
Must not decide when to issue (`DeviceLoader.step()` and `store()` do), wait
on the host, or read a host slot the loader was not handed.

How bytes move (sizes for Llama-3.1-8B, page 64: 8 MiB pages, 128 KiB per
(kv, layer) run; rates from scripts/bench_h2d.py on an H200, pinned copy_ of
the same bytes = 55 GB/s):
  - page_first: a page is one contiguous run but feeds 2*layers separate
    device tensors; copying per (page, layer) would be 64 launch-bound
    128 KiB copies per page. Consecutive host slots merge into one DMA copy
    (>= 8 MiB, 54 GB/s) into device staging, then one device kernel (one per
    layer when the K/V buffers are separate allocations) scatters it at
    1.4-1.8 TB/s, about 3 % of the PCIe time. Loader: 52 GB/s at 128 pages.
  - layer_first: in each (kv, layer) plane, pages consecutive on both sides
    merge into one DMA copy straight into the K/V buffers (51 GB/s when the
    pages are contiguous). Scattered pages make those copies 128 KiB each:
    8192 copies for 128 pages, Python-issue bound at 15 GB/s. There a gather
    kernel reads the pool through its device mapping (zero-copy, 50-51 GB/s
    in one launch per layer, whatever the page order) into staging, and the
    device scatter follows. Loader: 48 GB/s for 128 random pages (0.87 x
    pinned copy_): the PCIe read latency of zero-copy costs the rest.
  - `plan.choose` makes the call per batch (average DMA copy >= 1 MiB:
    DMA, else gather); `method="memcpy"|"gather"` forces one. DMA wins ties
    because it runs on the copy engines, not on the SMs a concurrent forward
    pass needs; zero-copy gathers occupy SMs while they wait on PCIe.
"""
import numpy as np
import torch

from . import plan
from .cuda import DONE


class Copies:
    """DeviceLoader's copy machinery, a mixin: the loader holds the state it
    reads (geometry, method, staging_pages, device, cuda, timing, the streams,
    the views made by `buffers`, the staging dict `_stage`)."""

    # --- host -> device -----------------------------------------------------
    def _issue_load(self, host: np.ndarray, dev: np.ndarray) -> list:
        """Queue one batch on the load stream; returns one event per layer."""
        g, S = self.geometry, self.staging_pages
        host, dev = plan.by_host(host, dev)
        n = len(host)
        runs = plan.copy_runs(g.layout, host, dev)
        how = plan.choose(self.method, g.layout, n, len(runs), g.page_bytes, g.run_bytes, self.can_gather)
        if how == plan.MEMCPY and g.layout == plan.LAYER_FIRST:
            return self._direct_layer_first(host, dev, runs, True, to_device=True)
        # layer_first gathers go layer by layer once the batch is big enough to hide
        # the per-layer launches (layer 0 is then usable first); one layer of
        # staging is reused, so a chunk may hold staging_pages * layers pages:
        # bigger kernels, measured 43 -> 50 GB/s for 128 pages on the H200.
        by_layer = how == plan.GATHER and g.layout == plan.LAYER_FIRST and n >= plan.PER_LAYER_MIN_PAGES
        chunk = S * g.num_layers if by_layer else S
        events = None
        for c0 in range(0, n, chunk):
            hs, ds = host[c0:c0 + chunk], dev[c0:c0 + chunk]
            last = c0 + chunk >= n  # earlier chunks precede it in stream order
            if by_layer:
                events = self._gather_by_layer(hs, ds, last)
                continue
            stage = self._staging("load")[:len(hs)]
            if how == plan.MEMCPY:  # page_first: one DMA per run of consecutive host slots
                for a, b in plan.runs(hs):
                    stage[a:b].copy_(self._host4[hs[a]:hs[a] + b - a], non_blocking=True)
            else:  # one zero-copy gather kernel for every layer of the chunk
                torch.index_select(self._mapped4, 0, self._index(hs), out=stage)
            events = self._scatter_all(stage, self._index(ds), last)
        return events

    def _scatter_all(self, stage, dev_idx, record: bool):
        """stage [n, kv, layer, W] -> K/V buffers at dev_idx."""
        L = self.geometry.num_layers
        if self._fused is not None:
            # All layers arrived together (a page holds them all): one kernel, one event.
            self._fused.index_copy_(2, dev_idx, stage.permute(1, 2, 0, 3))
            return [self._record(self._load_stream)] * L if record else None
        events = []
        for layer in range(L):
            self._scatter_layer(layer, stage[:, :, layer], dev_idx)
            if record:
                events.append(self._record(self._load_stream))
        return events or None

    def _scatter_layer(self, layer: int, stage_l, dev_idx) -> None:
        """stage_l [n, kv, W] -> layer `layer` of the K/V buffers."""
        if self._fused is not None:
            self._fused[:, layer].index_copy_(1, dev_idx, stage_l.transpose(0, 1))
        else:
            for kv, row in enumerate(self._bufw):
                row[layer].index_copy_(0, dev_idx, stage_l[:, kv])

    def _gather_by_layer(self, hs, ds, record: bool):
        g = self.geometry
        n, kvn, W = len(hs), g.kv_count, self._W
        # One layer's worth of staging, reused: stream order puts each gather after
        # the previous layer's scatter.
        part = self._staging("load").view(-1)[:n * kvn * W].view(n, kvn, W)
        host_idx, dev_idx = self._index(hs), self._index(ds)
        events = []
        for layer in range(g.num_layers):
            torch.index_select(self._mapped4[:, :, layer], 0, host_idx, out=part)
            self._scatter_layer(layer, part, dev_idx)
            if record:
                events.append(self._record(self._load_stream))
        return events or None

    def _direct_layer_first(self, hs, ds, runs, record: bool, *, to_device: bool):
        """layer_first DMA: per (kv, layer) plane, one copy per run consecutive on both sides."""
        stream = self._load_stream if to_device else self._store_stream
        events = []
        for layer in range(self.geometry.num_layers):
            for kv, row in enumerate(self._bufw):
                plane_host = self._host4[:, kv, layer]  # [N, W], contiguous in layer_first
                plane_dev = row[layer]
                for a, b in runs:
                    h0, d0, k = int(hs[a]), int(ds[a]), b - a
                    if to_device:
                        plane_dev[d0:d0 + k].copy_(plane_host[h0:h0 + k], non_blocking=True)
                    else:
                        plane_host[h0:h0 + k].copy_(plane_dev[d0:d0 + k], non_blocking=True)
            if record:
                events.append(self._record(stream))
        return events or None

    # --- device -> host -----------------------------------------------------
    def _issue_store(self, host: np.ndarray, dev: np.ndarray) -> None:
        g, S = self.geometry, self.staging_pages
        host, dev = plan.by_host(host, dev)
        for c0 in range(0, len(host), S):
            hs, ds = host[c0:c0 + S], dev[c0:c0 + S]
            runs = plan.copy_runs(g.layout, hs, ds)
            how = plan.choose(self.method, g.layout, len(hs), len(runs), g.page_bytes, g.run_bytes,
                              self._mapped4 is not None)
            if how == plan.MEMCPY and g.layout == plan.LAYER_FIRST:
                self._direct_layer_first(hs, ds, runs, False, to_device=False)
                continue
            stage = self._staging("store")[:len(hs)]
            dev_idx = self._index(ds)
            if self._fused is not None:
                stage.copy_(self._fused.index_select(2, dev_idx).permute(2, 0, 1, 3))
            else:
                for layer in range(g.num_layers):
                    for kv, row in enumerate(self._bufw):
                        stage[:, kv, layer].copy_(row[layer].index_select(0, dev_idx))
            if how == plan.MEMCPY:  # page_first: one DMA per run of consecutive host slots
                for a, b in runs:
                    self._host4[hs[a]:hs[a] + b - a].copy_(stage[a:b], non_blocking=True)
            else:  # zero-copy writes through the device mapping, any slot order
                self._mapped4.index_copy_(0, self._index(hs), stage)

    # --- staging, indices, events -------------------------------------------
    def _staging(self, direction: str) -> torch.Tensor:
        stage = self._stage.get(direction)
        if stage is None:
            g = self.geometry
            stage = torch.empty((self.staging_pages, g.kv_count, g.num_layers, self._W),
                                dtype=self._word, device=self.device)
            self._stage[direction] = stage
        return stage

    def _index(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int64))
        # Issued inside the stream context: the tiny pageable copy is ordered on that stream.
        return t.to(self.device, non_blocking=True) if self.cuda else t

    def _record(self, stream):
        if not self.cuda:
            return DONE
        ev = torch.cuda.Event(enable_timing=self.timing)
        ev.record(stream)
        return ev

    def _ready_event(self):
        if not self.cuda:
            return DONE
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def stream_wait(self, event, stream=None) -> None:
        if self.cuda and event is not DONE:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)
