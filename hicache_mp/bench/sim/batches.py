"""The reference scheduler's modelled GPU: which batch runs next, and what finishing one does.

Owns `Batch`, the choice of the next batch (a chunked prefill of ready
requests, FIFO within the `chunk_tokens` budget, skipping a request whose KV
is still on its way to the device, before a decode step of the running
ones), finishing a batch (prompt and decode tokens, requests done, their
device pages back) and the write-back of the pages a prefill chunk filled
(SGLang's `write_backup_storage`). Must not poll the engine, or settle a
prefetch but a best_effort one at its scheduling (`scheduler` does both).
"""
from __future__ import annotations

import time

from dataclasses import dataclass, field

INF = float("inf")   # the end of a batch whose layers are still loading (mp-direct)


@dataclass
class Batch:
    kind: str                        # prefill | decode
    start_s: float
    end_s: float
    items: list                      # [(req, tokens)]
    finished_some: bool = False      # finishing it finished some request
    charged_s: float = 0.0           # the forward's own time (the ComputeModel's)
    loads: list = field(default_factory=list)  # mp-direct: the loads its layers wait for


class Batches:
    """Scheduler's batch steps, a mixin: the scheduler holds the request lists
    (ready, prefetching, running, finished, consumed, backups, batches), the
    slots, the engine and config, and `_settle`; `q` is a scheduler `_Req`."""

    def _next_batch(self, now_s: float, now_ns: int) -> Batch | None:
        cfg = self.cfg
        queue = self.ready
        if cfg.policy == "best_effort" and self.prefetching:
            # SGLang checks a best_effort prefetch when it schedules the request,
            # and ends it there with whatever has landed.
            queue = sorted(self.ready + self.prefetching, key=fifo_order)
        self._device_wait = False
        if queue:
            budget = cfg.compute.chunk_tokens
            items, loads = [], []
            for q in queue:
                if budget <= 0:
                    break
                if q.seen_ns == 0 and q.op is not None:   # a best_effort prefetch still running
                    self._settle(q, now_ns)
                    self.prefetching.remove(q)
                    self.ready.append(q)
                if q.load is None and q.hit_pages and self.direct is not None:
                    # mp-direct's first chunk: its load starts with the forward
                    load = self.direct.start(q.r.rid, q.keys[:q.hit_pages])
                    if load is None:
                        self._device_wait = True
                        continue  # no slots (or device pages) free yet
                    q.load = load
                    loads.append(load)
                if q.op is not None:  # first chunk: its pages go to the GPU now
                    if q.h2d is not None and not q.h2d.done:
                        self._device_wait = True
                        continue  # its KV is still on the way to the device
                    self.consumed.append((q.op, q.slots, q.r.rid, q.seen_ns))
                    q.op = None
                take = min(q.r.prompt_len - q.done_tokens, budget)
                q.marks.setdefault("first_batch", now_s)
                items.append((q, take))
                budget -= take
            self.ready.sort(key=fifo_order)
            if items:
                tokens = sum(t for _, t in items)
                charged = cfg.compute.prefill_s(tokens)
                # With loads its end waits for their layers (DirectLoads.end_s).
                end = INF if loads else now_s + charged
                return Batch("prefill", now_s, end, items, charged_s=charged, loads=loads)
            # Every ready request's KV is still on the way to the device: none
            # can be scheduled (SGLang's prefill skips them), so decode goes on.
        if self.running:
            step = cfg.compute.decode_s(1)
            return Batch("decode", now_s, now_s + step, [(q, 1) for q in self.running],
                         charged_s=step)
        return None

    def _finish(self, batch: Batch, now_s: float) -> None:
        before_done = len(self.finished)
        if batch.kind == "decode":
            still = []
            for q, _ in batch.items:
                q.token_s.append(now_s)
                (self.finished if len(q.token_s) >= q.r.output_len else still).append(q)
            self.running = still
        else:
            wait = 0.0  # only a batch with loads waits for layers
            if batch.loads:
                now_ns = time.perf_counter_ns()
                for load in batch.loads:
                    self._direct_landed(load, now_ns)
                wait = max(0.0, batch.end_s - batch.start_s - batch.charged_s)
            for q, take in batch.items:
                before = q.done_tokens
                q.done_tokens += take
                q.prefill_s += batch.charged_s
                q.wait_s += wait
                self._write_back(q, before, q.done_tokens)
                if q.done_tokens >= q.r.prompt_len:
                    q.token_s.append(now_s)   # prefill yields the first token
                    (self.finished if q.r.output_len <= 1 else self.running).append(q)
            self.ready = [q for q in self.ready if q.done_tokens < q.r.prompt_len]
        batch.finished_some = len(self.finished) > before_done
        if self.dev_slots is not None:
            for q in self.finished[before_done:]:
                if q.dev is not None:
                    self.dev_slots.release(q.dev)
                    q.dev = None
        if self.direct is not None:
            for q in self.finished[before_done:]:
                if q.load is not None:
                    self.direct.release_device(q.load)
        self.batches.append((batch.kind, batch.start_s, batch.end_s,
                             sum(t for _, t in batch.items), len(batch.items)))

    def _write_back(self, q, before: int, after: int) -> None:
        """Back up the pages this chunk filled, beyond the ones storage already has."""
        if self.pool is None or not q.wb_keys:
            return  # the ideal backend writes nothing
        ps = self.cfg.page_size
        first_wb = len(q.keys)       # computed pages start after the workload's cached prefix
        lo = max(before // ps, first_wb)
        hi = min(after, q.r.prompt_len) // ps
        if hi <= lo:
            return
        keys = q.wb_keys[lo - first_wb:hi - first_wb]
        slots = self.slots.alloc(len(keys))
        if slots is None:
            self.backup_skipped += len(keys)
            return
        gen = self.cfg.page_bytes_gen
        for slot, key in zip(slots, keys):
            gen.stamp(self.pool, slot, key)
        self.backups.append((q.r.rid, self.engine.backup(keys, slots), slots))


def fifo_order(q):
    return (q.admit_s, q.r.rid)
