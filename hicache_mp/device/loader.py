"""DeviceLoader: moves KV pages between the shared-memory host pool and the GPU KV cache.

    scheduler loop                         DeviceLoader                       GPU
    --------------                         ------------                       ---
    loader.poll()  ─► engine.poll(): op.completed_pages grows
                   ─► step(): per load handle: pages newly landed ─► load stream: host pool (registered)
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
nor hand the loader slots an engine op is still using. The loader drives
the engine (poll() polls it, then steps), never the other way round; built
with `engine=`, it asks the engine to close it first (engine.on_close), as
its registration must end while the pool is still mapped.

The parts: `buffers` makes the K/V buffers and the views of them and
of the pool, `copies` queues one batch's copies (and says how bytes
move for each layout), `plan` chooses the method, `handles`
holds a caller's progress, `cuda` the registration; this class says
when: step() issues pages newly landed and backs up stores once copied.
"""
import time

import numpy as np
import torch

from . import plan
from .buffers import host_views, kv_buffers
from .copies import Copies
from .cuda import stream_context
from .handles import LoadHandle, StoreHandle


class DeviceLoader(Copies):
    def __init__(self, host_pool, *, device=None, num_device_pages: int | None = None,
                 k_buffers=None, v_buffers=None, engine=None, method: str = "auto",
                 staging_pages: int = 16, min_step_pages: int = 1, timing: bool = False):
        """`host_pool`: a HostPool (or anything with .geometry, .num_pages, .tensor).

        Either give `num_device_pages` (the loader allocates the K/V buffers as
        one tensor, so page_first scatters take one kernel) or adopt the
        caller's `k_buffers`/`v_buffers` (lists of [tokens, heads, head_dim]).
        `engine`: the engine whose pool this is. Needed by poll(),
        store(keys=...) and handle.wait() on running ops; the engine's close()
        then closes this loader first.
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
        (self.num_device_pages, self.k_buffers, self.v_buffers, self._bufw,
         self._fused) = kv_buffers(g, self.device, self._word, num_device_pages, k_buffers, v_buffers)
        self._host4, self._mapped4, self._registration = host_views(
            host_pool, g, self._word, self._W, self.device, self.cuda, method)
        self._load_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._store_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._stage = {}  # direction -> [staging_pages, kv, layers, W] words
        self._clock = None
        if self.cuda and timing:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(self._load_stream)
            ref.synchronize()
            self._clock = (ref, time.perf_counter_ns())
        if engine is not None:
            engine.on_close(self.close)

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

    def poll(self, lazy: bool = False) -> int:
        """The scheduler loop's one call: the engine's poll(), then step().
        Returns what engine.poll() returns. Needs a loader built with engine=."""
        if self.engine is None:
            raise ValueError("DeviceLoader.poll() needs a loader built with engine=")
        n = self.engine.poll(lazy)
        self.step()
        return n

    def step(self) -> int:
        """Issue copies for newly landed pages; submit backups whose copies finished.

        Non-blocking and cheap when there is nothing to do: call it every
        scheduler loop, after engine.poll() (or call poll(), which does both).
        With engine=, a step after which no page landed costs one compare,
        however many loads are in flight. Returns the pages issued.
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
        if self.engine is None:
            return self._advance_all()
        # Every page outcome the engine applies to an op bumps its count
        # (hicache_mp.engine.ledger). With no outcome since the last look, no
        # load has a page to issue or has ended: one compare, however many
        # loads are in flight (a scheduler polls far more often than pages
        # land; decision 83). The engine makes the look under its lock.
        self._looked_at, n = self.engine.if_outcomes_since(self._looked_at, self._advance_all)
        return n or 0

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
            ready = h.take_ready()
            if ready is not None and self.cuda:
                self._load_stream.wait_event(ready)
            ev0 = self._record(self._load_stream) if self._clock else None
            layer_events = self._issue_load(h.host_pages[start:end], h.device_pages[start:end])
            last = layer_events[-1]
        h.issued_batch(end, last, layer_events)
        if self.timing:
            h.batches.append((start, end, issue_ns, ev0, last))
        return end - start

    # --- backups ------------------------------------------------------------
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
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DeviceLoader is closed")
