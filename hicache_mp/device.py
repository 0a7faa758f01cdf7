"""DeviceLoader: moves KV pages between the shared-memory host pool and the GPU KV cache.

    scheduler loop                         DeviceLoader                       GPU
    --------------                         ------------                       ---
    engine.poll()  ─► op.completed_pages grows
    loader.step()  ─► per load handle: pages newly landed ─► load stream: host pool (registered)
                                                              ─► staging ─► K/V buffers,
                                                              one event per layer
    forward pass   ─► handle.wait_layer(l) ──────────────────► stream waits, host does not
    loader.store(device_pages, host_pages, keys)
                   ─► store stream: K/V buffers ─► host slots; step() then calls
                      engine.backup(keys, host_pages) once the copy has finished

Owns the CUDA registration of the host pool, one stream for loads and one for
stores, the device KV cache in SGLang's form (per-layer K and V tensors
``[tokens, heads, head_dim]``, page p = tokens ``[p*page_size, (p+1)*page_size)``,
allocated here or adopted from the caller), staging buffers and the handles.
Without CUDA (or with ``device="cpu"``) the same code runs with plain tensor
copies and events that have always completed.

Must not: do file I/O (the engine's workers do), block the scheduler (`step()`
only queues asynchronous work), or read a host slot before its op says it
landed. The caller must not reuse host slots before a load handle is `done`,
nor hand the loader slots an engine op is still using. Close the loader
before the engine: the registration must end while the pool is still mapped.

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
  - `device_plan.choose` makes the call per batch (average DMA copy >= 1 MiB:
    DMA, else gather); `method="memcpy"|"gather"` forces one. DMA wins ties
    because it runs on the copy engines, not on the SMs a concurrent forward
    pass needs; zero-copy gathers occupy SMs while they wait on PCIe.
"""
import time

import numpy as np
import torch

from . import device_plan as plan
from .device_cuda import DONE, HostRegistration, mapped_bytes, stream_context
from .device_handles import LoadHandle, StoreHandle


class DeviceLoader:
    def __init__(self, host_pool, *, device=None, num_device_pages: int | None = None,
                 k_buffers=None, v_buffers=None, engine=None, method: str = "auto",
                 staging_pages: int = 16, min_step_pages: int = 1, timing: bool = False):
        """`host_pool`: a HostPool (or anything with .geometry, .num_pages, .tensor).

        Either give `num_device_pages` (the loader allocates the K/V buffers as
        one tensor, so page_first scatters take one kernel) or adopt the
        caller's `k_buffers`/`v_buffers` (lists of [tokens, heads, head_dim]).
        `engine`: needed by store(keys=...) and by handle.wait() on running ops.
        `staging_pages`: device staging, in pages, per direction (bounds memory).
        `min_step_pages`: step() waits for this many newly landed pages (or the
        end of the op) before issuing, to trade latency for fewer launches.
        """
        if method not in plan.METHODS:
            raise ValueError(f"method must be one of {plan.METHODS}, got {method!r}")
        if staging_pages <= 0 or min_step_pages <= 0:
            raise ValueError("staging_pages and min_step_pages must be positive")
        g = host_pool.geometry
        self.geometry, self.host_pool, self.engine = g, host_pool, engine
        self.method, self.staging_pages, self.min_step_pages = method, staging_pages, min_step_pages
        self.timing = timing
        if k_buffers is not None:
            device = k_buffers[0].device
        self.device = torch.device(device if device is not None else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._closed = False
        self._registration = None
        self._loads: list[LoadHandle] = []
        self._looked_at = None  # the engine's completion count when step() last looked at _loads
        self._stores: list[StoreHandle] = []
        # Everything is moved as 8-byte words when the run allows it: wider loads for
        # the gather/scatter kernels, and the dtype does not matter to them.
        self._word = torch.int64 if g.run_bytes % 8 == 0 else torch.uint8
        self._W = g.run_bytes // (8 if self._word == torch.int64 else 1)
        self._setup_buffers(num_device_pages, k_buffers, v_buffers)
        self._setup_host()
        self._load_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._store_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._stage = {}  # direction -> [staging_pages, kv, layers, W] words
        self._clock = None
        if self.cuda and timing:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(self._load_stream)
            ref.synchronize()
            self._clock = (ref, time.perf_counter_ns())

    # --- set-up -------------------------------------------------------------
    def _setup_buffers(self, num_device_pages, k_buffers, v_buffers) -> None:
        g = self.geometry
        kvn, L, P = g.kv_count, g.num_layers, g.page_size
        dtype = getattr(torch, g.dtype)
        if k_buffers is None:
            if not isinstance(num_device_pages, int) or num_device_pages <= 0:
                raise ValueError("give num_device_pages (a positive int) or k_buffers/v_buffers")
            base = torch.empty((kvn, L, num_device_pages * P, g.num_kv_heads, g.head_dim),
                               dtype=dtype, device=self.device)
            buffers = [[base[kv, layer] for layer in range(L)] for kv in range(kvn)]
        else:
            if kvn == 2 and v_buffers is None:
                raise ValueError("v_buffers is required unless the geometry is MLA")
            buffers = [list(k_buffers)] + ([list(v_buffers)] if kvn == 2 else [])
            ok = all(len(row) == L for row in buffers) and all(
                b.dim() == 3 and tuple(b.shape[1:]) == (g.num_kv_heads, g.head_dim) and b.dtype == dtype
                and b.is_contiguous() and b.device == self.device for row in buffers for b in row)
            if not ok:
                raise ValueError(f"K/V buffers must be {L} contiguous [tokens, {g.num_kv_heads}, "
                                 f"{g.head_dim}] {g.dtype} tensors on one device")
            num_device_pages = min(b.shape[0] for row in buffers for b in row) // P
            if num_device_pages <= 0:
                raise ValueError("K/V buffers hold less than one page")
        self.num_device_pages = num_device_pages
        self.k_buffers = buffers[0]
        self.v_buffers = buffers[1] if kvn == 2 else None
        # [device page, run words] per (kv, layer): one row is one page of one layer.
        self._bufw = [[b[:num_device_pages * P].reshape(num_device_pages, -1).view(self._word)
                       for b in row] for row in buffers]
        self._fused = _fuse(self._bufw)

    def _setup_host(self) -> None:
        g, pool = self.geometry, self.host_pool
        N, kvn, L, W = pool.num_pages, g.kv_count, g.num_layers, self._W
        host = pool.tensor
        flat = host.reshape(-1).view(torch.uint8)
        self._host4 = _host4(flat.view(self._word), g.layout, N, kvn, L, W)
        self._mapped4 = None
        if self.cuda:
            ptr, nbytes = host.data_ptr(), flat.numel()
            self._registration = HostRegistration(ptr, nbytes)
            mapped = mapped_bytes(ptr, nbytes, self.device)
            if mapped is not None:
                self._mapped4 = _host4(mapped.view(self._word), g.layout, N, kvn, L, W)
        elif self.method == plan.GATHER or self.method == "auto":
            self._mapped4 = self._host4  # on the CPU, "gather" is plain index_select

    # --- public API ---------------------------------------------------------
    @property
    def can_gather(self) -> bool:
        """Whether the zero-copy gather path is available (the pool has a device mapping)."""
        return self._mapped4 is not None

    def load(self, op, device_pages, *, min_step_pages: int | None = None) -> LoadHandle:
        """Load `op`'s pages into `device_pages` (same order) as they land."""
        self._check_open()
        dev = plan.check_pages(device_pages, self.num_device_pages, "device_pages")
        if len(dev) != op.num_pages:
            raise ValueError(f"op has {op.num_pages} pages but {len(dev)} device pages were given")
        h = LoadHandle(self, op, np.asarray(op.host_pages, dtype=np.int64), dev, self._ready_event())
        h.min_step_pages = min_step_pages or self.min_step_pages
        try:
            op.device_event = h  # the engine exposes per-op device readiness through this slot
        except AttributeError:
            pass
        self._loads.append(h)
        self._advance(h)
        return h

    def load_pages(self, host_pages, device_pages) -> LoadHandle:
        """Load pages already resident in host slots (no op): SGLang's load_back."""
        self._check_open()
        host = plan.check_pages(host_pages, self.host_pool.num_pages, "host_pages")
        dev = plan.check_pages(device_pages, self.num_device_pages, "device_pages")
        if len(host) != len(dev):
            raise ValueError(f"{len(host)} host pages but {len(dev)} device pages")
        h = LoadHandle(self, None, host, dev, self._ready_event())
        h.min_step_pages = 1
        self._advance(h)
        return h

    def store(self, device_pages, host_pages, keys=None) -> StoreHandle:
        """Copy device pages into host slots; with `keys`, back them up once copied."""
        self._check_open()
        dev = plan.check_pages(device_pages, self.num_device_pages, "device_pages")
        host = plan.check_pages(host_pages, self.host_pool.num_pages, "host_pages")
        if len(host) != len(dev):
            raise ValueError(f"{len(dev)} device pages but {len(host)} host pages")
        if keys is not None:
            keys = list(keys)
            if len(keys) != len(host):
                raise ValueError(f"{len(keys)} keys but {len(host)} host pages")
            if self.engine is None:
                raise ValueError("store(keys=...) needs a loader built with engine=")
        ready = self._ready_event()
        with stream_context(self._store_stream):
            if self.cuda:
                self._store_stream.wait_event(ready)  # the forward pass wrote these pages
            self._issue_store(host, dev)
            event = self._record(self._store_stream)
        h = StoreHandle(self, event, host, dev, keys)
        if keys is not None:
            self._stores.append(h)
            self._submit_backups()
        return h

    def step(self) -> int:
        """Issue copies for newly landed pages; submit backups whose copies finished.

        Non-blocking and cheap when there is nothing to do: call it every
        scheduler loop, after engine.poll() (an attached engine's poll() calls
        it, and then a step after which no page landed costs one compare,
        however many loads are in flight). Returns the pages issued.
        """
        if self._closed:
            return 0
        n = 0
        if self._loads:
            n = self._step_loads()
        if self._stores:
            self._submit_backups()
        return n

    def close(self) -> None:
        """Finish queued copies, unregister the pool, drop every view of it."""
        if self._closed:
            return
        self._closed = True
        if self.cuda:
            self._load_stream.synchronize()
            self._store_stream.synchronize()
        self._host4 = self._mapped4 = None
        self._stage.clear()
        self._loads, self._stores = [], []
        if self._registration is not None:
            self._registration.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def timeline(self, handle: LoadHandle) -> list[dict]:
        """Per issued batch: pages, host issue time, GPU start/end (perf_counter ns). Needs timing=True."""
        out = []
        for start, end, issue_ns, ev0, ev1 in handle.batches:
            row = {"pages": (start, end), "issue_ns": issue_ns}
            if self._clock is not None:
                ev1.synchronize()
                ref, ref_ns = self._clock
                row["gpu_start_ns"] = ref_ns + int(ref.elapsed_time(ev0) * 1e6)
                row["gpu_end_ns"] = ref_ns + int(ref.elapsed_time(ev1) * 1e6)
            out.append(row)
        return out

    # --- loads --------------------------------------------------------------
    def _step_loads(self) -> int:
        eng = self.engine
        if eng is None or getattr(eng, "loader", None) is not self:
            return self._advance_all()
        # Driven by the engine's poll() (attach_loader): every page outcome the
        # engine applies to an op bumps its completion count (EngineCore._seq,
        # hicache_mp.books), always under its lock, which poll() holds here. With
        # no outcome since the last look, no load has a page to issue or has
        # ended: one compare, however many loads are in flight (a scheduler
        # polls far more often than pages land; decision 83).
        with eng._lock:
            seq = eng._seq
            if seq == self._looked_at:
                return 0
            n = self._advance_all()
            self._looked_at = seq
            return n

    def _advance_all(self) -> int:
        n = 0
        for h in self._loads:
            n += self._advance(h)
        self._loads = [h for h in self._loads if not h.all_issued]
        return n

    def _advance(self, h: LoadHandle) -> int:
        avail = h.available
        new = avail - h.issued
        if new <= 0 or (new < h.min_step_pages and not h.source_done):
            return 0
        start, end = h.issued, avail
        issue_ns = time.perf_counter_ns()
        with stream_context(self._load_stream):
            if h._ready is not None:
                if self.cuda:
                    self._load_stream.wait_event(h._ready)
                h._ready = None
            ev0 = self._record(self._load_stream) if self._clock else None
            layer_events = self._issue_load(h.host_pages[start:end], h.device_pages[start:end])
            last = layer_events[-1]
        h._issued_batch(end, last, layer_events)
        if self.timing:
            h.batches.append((start, end, issue_ns, ev0, last))
        return end - start

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

    # --- stores -------------------------------------------------------------
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

    def _submit_backups(self) -> None:
        still = []
        for h in self._stores:
            if h.backup_op is None and h.error is None:
                if not h.event.query():
                    still.append(h)
                    continue
                try:
                    h.backup_op = self.engine.backup(h.keys, h.host_pages)
                except Exception as exc:  # never let one bad store break the scheduler loop
                    h.error = exc
        self._stores = still

    # --- helpers ------------------------------------------------------------
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

    def _ready_event(self):
        if not self.cuda:
            return DONE
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _record(self, stream):
        if not self.cuda:
            return DONE
        ev = torch.cuda.Event(enable_timing=self.timing)
        ev.record(stream)
        return ev

    def _stream_wait(self, event, stream=None) -> None:
        if self.cuda and event is not DONE:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DeviceLoader is closed")


def _host4(words: torch.Tensor, layout: str, N: int, kvn: int, L: int, W: int) -> torch.Tensor:
    """The pool as [host page, kv, layer, W] words, whatever the layout (a strided view)."""
    if layout == plan.PAGE_FIRST:
        return words.view(N, kvn, L, W)
    return words.view(kvn, L, N, W).permute(2, 0, 1, 3)


def _fuse(bufw):
    """One [kv, layer, page, W] view over all K/V buffers if they sit on one regular grid.

    True when the loader allocated them; SGLang allocates one tensor per layer,
    and then scatters take one kernel per (kv, layer).
    """
    first = bufw[0][0]
    kvn, L = len(bufw), len(bufw[0])
    storage = first.untyped_storage().data_ptr()
    es = first.element_size()
    if any(b.untyped_storage().data_ptr() != storage for row in bufw for b in row):
        return None
    step_l = bufw[0][1].data_ptr() - first.data_ptr() if L > 1 else 0
    step_kv = bufw[1][0].data_ptr() - first.data_ptr() if kvn > 1 else 0
    if step_l % es or step_kv % es or step_l < 0 or step_kv < 0:
        return None
    for kv in range(kvn):
        for layer in range(L):
            if bufw[kv][layer].data_ptr() - first.data_ptr() != kv * step_kv + layer * step_l:
                return None
    return first.as_strided((kvn, L) + tuple(first.shape), (step_kv // es, step_l // es) +
                            tuple(first.stride()), first.storage_offset())
