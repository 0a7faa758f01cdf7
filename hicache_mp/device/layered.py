"""LayerCopies: the DeviceLoader's layer-wise mode, for SGLang's direct linker.

    workers ─► host slots (shm, registered) ─► load stream: one DMA per slot run
                                               ─► per layer, index_copy into the
                                                  device pool's token rows; event
    device pool's token rows ─► store stream (after the forward's events):
              per layer, index_select ─► one DMA into host slots; event ─► backup

Owns the CUDA registration of the linker's host pools, one load and one store
stream, the device staging those copies need (held until their event has
completed) and the copy math between a slot's page-first bytes
`[kv][layer][token][row]` and the device pool's per-layer `[token, row]`
tensors (SGLang's `k_buffer`/`v_buffer`, or MLA's `kv_buffer`), addressed by
token index, so any slot order and any device order work.

Also owns the layer-group rule (`auto_groups`) and the slot runs a layered
load takes (`SlotRuns`), shared by the linker and the reference scheduler's
direct-path run. Must not: do file I/O, decide when a layer may be copied
(the linker does, from its ops), or block: every call queues asynchronous work and returns an
event; `synchronize` is the caller's choice. Without CUDA the same calls run
as plain tensor copies with events that have always completed (the CPU tests).
"""
import torch

from .cuda import DONE, HostRegistration, stream_context


def row_view(t: torch.Tensor) -> torch.Tensor:
    """A per-layer device tensor `[tokens, ...]` as `[tokens, row bytes]` uint8."""
    if not t.is_contiguous():
        raise ValueError("a device KV buffer must be contiguous to be copied by rows")
    return t.view(torch.uint8).reshape(t.shape[0], -1)


class LayerCopies:
    def __init__(self, planes: list, device):
        """`planes[kv][layer]`: the device pool's per-layer tensors (K then V;
        one list for MLA), each `[tokens, ...]` with the same row bytes."""
        self.planes = [[row_view(t) for t in kv] for kv in planes]
        self.kv_count = len(planes)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.load_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.store_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._registrations = []
        self._held = []  # (event, tensors): device staging kept until its copy is done

    def register(self, host: torch.Tensor) -> None:
        """Pin a host pool for DMA (cudaHostRegister) until close()."""
        if self.cuda:
            self._registrations.append(HostRegistration(host.data_ptr(),
                                                        host.numel() * host.element_size()))

    # --- the KV pool: a page-first slot is [kv][layers][token][row], row planes in that order
    def load(self, host: torch.Tensor, first: int, n: int, layer0: int, tokens: torch.Tensor,
             after=None):
        """Queue slots [first, first+n) (each holding layers layer0.. of one page)
        into the device rows `tokens` (n * page tokens, page-major); the event."""
        group = host.shape[2]  # layers a slot holds
        planes = [self.planes[kv][layer0 + j] for kv in range(self.kv_count) for j in range(group)]
        return self.load_rows(host, first, n, planes, host.shape[3], tokens, after)

    def store(self, host: torch.Tensor, first: int, n: int, tokens: torch.Tensor, ready=()):
        """Queue the device rows `tokens` (n whole pages) into slots [first, first+n)
        once every event of `ready` has completed (the forward wrote them); the event."""
        planes = [t for kv in self.planes for t in kv]
        return self.store_rows(host, first, n, planes, host.shape[3], tokens, ready)

    # --- any pool whose page is, for each plane in order, rows_per_page rows ---
    def load_rows(self, host: torch.Tensor, first: int, n: int, planes: list, rows_per_page: int,
                  rows: torch.Tensor, after=None):
        """Queue slots [first, first+n) of a pool whose page is, for each plane in
        order, `rows_per_page` rows (the KV pool's page-first slots; a side pool's
        opaque bytes) into `planes` at `rows`; the event."""
        views = [row_view(t) for t in planes]
        run = host[first:first + n].reshape(n, -1).view(torch.uint8)
        with stream_context(self.load_stream):
            if after is not None and self.cuda:
                self.load_stream.wait_event(after)
            stage = run.to(self.device, non_blocking=True) if self.cuda else run
            idx = rows.to(self.device, non_blocking=True)
            off = 0
            for v in views:
                width = rows_per_page * v.shape[1]
                v.index_copy_(0, idx, stage[:, off:off + width].reshape(-1, v.shape[1]))
                off += width
            return self._event(self.load_stream, (stage, idx))

    def store_rows(self, host: torch.Tensor, first: int, n: int, planes: list, rows_per_page: int,
                   rows: torch.Tensor, ready=()):
        """Queue `planes` at `rows` (n pages) into slots [first, first+n); the event."""
        views = [row_view(t) for t in planes]
        run = host[first:first + n].reshape(n, -1).view(torch.uint8)
        with stream_context(self.store_stream):
            if self.cuda:
                for ev in ready:
                    self.store_stream.wait_event(ev)
            idx = rows.to(self.device, non_blocking=True)
            stage = torch.empty(run.shape, dtype=torch.uint8, device=self.device) \
                if self.cuda else run
            off = 0
            for v in views:
                width = rows_per_page * v.shape[1]
                stage[:, off:off + width] = v.index_select(0, idx).reshape(n, width)
                off += width
            if self.cuda:
                run.copy_(stage, non_blocking=True)
            return self._event(self.store_stream, (stage, idx))

    def _event(self, stream, keep):
        if not self.cuda:
            return DONE
        ev = torch.cuda.Event()
        ev.record(stream)
        self._held = [(e, k) for e, k in self._held if not e.query()]
        self._held.append((ev, keep))
        return ev

    def close(self) -> None:
        """Finish queued copies, then unpin the host pools."""
        if self.cuda:
            self.load_stream.synchronize()
            self.store_stream.synchronize()
        self._held = []
        for r in self._registrations:
            r.close()
        self._registrations = []


def auto_groups(layers: int, page_bytes: int) -> int:
    """The most layer groups (at most 8) that divide `layers` and keep a group's
    reads at 1 MiB or more: smaller reads cost more in opens than they gain."""
    best = 1
    for g in range(1, min(8, layers) + 1):
        if layers % g == 0 and page_bytes // g >= (1 << 20):
            best = g
    return best


class SlotRuns:
    """Free runs of a host pool's slots: first fit, neighbours merged when given
    back. LayerCopies copies a run of slots (one DMA), so a batch's slots are one run."""

    def __init__(self, size: int):
        self.free = [(0, size)]

    def take(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[i] = (start + n, length - n)
                if length == n:
                    del self.free[i]
                return start
        return None

    def give(self, start: int, n: int) -> None:
        runs = sorted(self.free + [(start, n)])
        merged = [runs[0]]
        for s, length in runs[1:]:
            ps, pl = merged[-1]
            if ps + pl == s:
                merged[-1] = (ps, pl + length)
            else:
                merged.append((s, length))
        self.free = merged
