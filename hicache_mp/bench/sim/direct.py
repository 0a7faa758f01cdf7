"""DirectLoads: the reference scheduler's model of SGLang's direct L3 path (the `mp-direct` run).

SGLang 0.5.23's `UnifiedRadixCache` with hicache_mp's linker (decision 101)
has no host tier: a request's cached prefix is loaded when its first prefill
chunk is scheduled, a layer group at a time, and the forward waits per
layer, so layer l computes once its group is on the device while later
groups still load. This owns that path for one run: the reader engine
(`read_parts` = groups, a slot per page group, one read op per group, group
0 of every page first, as the linker issues them), its slot runs, the device
copies (device.layered.LayerCopies into device KV planes, as the linker
makes them; on a run without a device a landed group counts as on it), the
device pages a load holds until its request ends, each load's groups
(landed, copied, seen on the device) and the batch-end rule. Must not run
the loop or choose batches (`scheduler`, `batches`), write back (the run's
whole-page engine does: a layer-parts engine reads only) or format output.

A batch's end: its charged time d is the forward's, spread evenly over the
layer groups; group k's share starts once the share before it ended and
group k of every load in the batch is on the device (as the loop saw it):
end = fold over k of max(t, on_device_k) + d / G, from the batch's start.
The time past start + d is the batch's layer wait, the read the forward
did not hide.
"""
from __future__ import annotations

import torch

from hicache_mp.device.layered import LayerCopies, SlotRuns

from .slots import HostSlots


class Load:
    """One request's prefix on its way to the device, a layer group at a time."""

    def __init__(self, rid: int, keys: list, ops: list, first: int, dev: list | None,
                 tokens, groups: int):
        self.rid, self.keys, self.ops, self.first, self.dev = rid, keys, ops, first, dev
        self.tokens = tokens                    # device rows, page-major (None: no device)
        self.events = [None] * groups           # group g's copy, once queued
        self.on_device_s = [None] * groups      # when the loop saw group g on the device
        self.failed = False                     # a group's read did not land whole
        self.pending = 0                        # groups before it are all on the device

    @property
    def n(self) -> int:
        return len(self.keys)


class DirectLoads:
    def __init__(self, reader, groups: int, page_size: int, planes=None, device=None,
                 device_pages: int = 0):
        """`reader`: an engine built with read_parts=`groups` (groups 1: whole
        pages); `planes[kv][layer]`: the device KV pool's per-layer tensors of
        `device_pages` pages, or None for a run without a device."""
        self.reader, self.groups, self.page_size = reader, groups, page_size
        self.device = device
        self.group_layers = reader.geometry.num_layers // groups
        self.runs = SlotRuns(reader.host_pool.num_pages)
        self.copies = LayerCopies(planes, device) if planes is not None else None
        self.dev_slots = HostSlots(device_pages) if planes is not None else None
        if self.copies is not None:
            self.copies.register(reader.host_pool.tensor)
        self.loading: list[Load] = []

    def start(self, rid: int, keys: list) -> Load | None:
        """Read `keys`' pages group by group into one run of slots (and device
        pages): the load, or None where the slots (or device pages) are taken."""
        n, g_count = len(keys), self.groups
        first = self.runs.take(g_count * n)
        if first is None:
            return None
        dev = tokens = None
        if self.dev_slots is not None:
            dev = self.dev_slots.alloc(n)
            if dev is None:
                self.runs.give(first, g_count * n)
                return None
            ps = self.page_size
            tokens = (torch.tensor(dev, dtype=torch.int64)[:, None] * ps
                      + torch.arange(ps, dtype=torch.int64)).reshape(-1)
        ops = []
        for g in range(g_count):  # group-major: every worker reads group 0 first
            ops.append(self.reader.prefetch(
                keys, range(first + g * n, first + (g + 1) * n),
                parts=[g] * n if g_count > 1 else None, policy="wait_complete"))
        load = Load(rid, list(keys), ops, first, dev, tokens, g_count)
        self.loading.append(load)
        return load

    def poll(self, now_s: float) -> None:
        """The reader's poll, then `step`: the loop's one call per iteration."""
        self.reader.poll()
        if self.loading:
            self.step(now_s)

    def step(self, now_s: float) -> None:
        """Queue each landed group's copy; note when each group is seen on the
        device (`now_s`: the loop's clock, seconds from the run's start)."""
        still = []
        host = self.reader.host_pool.tensor
        for load in self.loading:
            n = load.n
            # groups land in about their order: look from the first not there yet
            for g in range(load.pending, self.groups):
                if load.on_device_s[g] is not None:
                    continue
                op = load.ops[g]
                if load.events[g] is None:
                    if not op.done:
                        continue
                    if op.status != "ok":
                        # The linker fails the batch (SGLang recomputes): here the
                        # group counts as there, and the run's byte check says so.
                        load.failed = True
                        load.on_device_s[g] = now_s
                        continue
                    load.events[g] = True if self.copies is None else self.copies.load(
                        host, load.first + g * n, n, g * self.group_layers, load.tokens)
                if load.events[g] is True or load.events[g].query():
                    load.on_device_s[g] = now_s
            while load.pending < self.groups and load.on_device_s[load.pending] is not None:
                load.pending += 1
            if load.pending < self.groups:
                still.append(load)
        self.loading = still

    def end_s(self, start_s: float, charged_s: float, loads: list) -> float | None:
        """When a batch started at `start_s` with `charged_s` of forward ends,
        given its loads' groups on the device; None while one is still on its way."""
        t, share = start_s, charged_s / self.groups
        for g in range(self.groups):
            for load in loads:
                at = load.on_device_s[g]
                if at is None:
                    return None
                t = max(t, at)
            t += share
        return t

    def slots_of(self, load: Load, g: int) -> range:
        return range(load.first + g * load.n, load.first + (g + 1) * load.n)

    def release_slots(self, load: Load) -> None:
        """Its host slots back (every group on the device: read and copied)."""
        self.runs.give(load.first, self.groups * load.n)

    def release_device(self, load: Load) -> None:
        """Its device pages back (its request ended)."""
        if load.dev is not None:
            self.dev_slots.release(load.dev)
            load.dev = None

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()


def device_planes(geometry, pages: int, device) -> list:
    """Device KV planes of `pages` pages in SGLang's form: per layer, K then V (one
    latent plane for MLA), each [tokens, heads, head_dim] of the pages' dtype."""
    dtype = getattr(torch, geometry.dtype)
    tokens = pages * geometry.page_size
    shape = (tokens, geometry.num_kv_heads, geometry.head_dim)
    return [[torch.zeros(shape, dtype=dtype, device=device) for _ in range(geometry.num_layers)]
            for _ in range(geometry.kv_count)]
