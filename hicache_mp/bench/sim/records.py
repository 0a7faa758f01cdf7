"""What one run of the reference scheduler measured: per-op records and the run's result.

Owns `OpRecord` (one prefetch or write-back op, frozen when the run ends),
`op_record` that takes one from an engine op, and `RunResult`. Must not
compute figures from them (`report.figures`, `profile`) or run anything.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .summary import RequestResult


@dataclass
class OpRecord:
    rid: int
    kind: str
    pages: int
    ok_pages: int
    nbytes: int
    status: str
    submit_ns: int
    first_ns: int
    done_ns: int
    seen_ns: int                     # when the scheduler acted on it (0: never needed to)
    io_ns: int
    gbps: float | None
    landed_ns: np.ndarray
    worker_of: np.ndarray | None
    h2d_seen_ns: int = 0             # when the scheduler saw every landed page on the device


@dataclass
class RunResult:
    name: str
    backend: str
    policy: str
    yield_ms: float
    t0_ns: int
    duration_s: float
    loop_iters: int
    requests: list[RequestResult]
    hit_tokens: list[int]
    prefetch: list[OpRecord]
    backups: list[OpRecord]
    batches: list[tuple]             # (kind, start_s, end_s, tokens, requests)
    verified_pages: int
    verify_failures: list[int]       # rids whose first page held wrong bytes
    backup_skipped_pages: int
    slots_low_water: int
    engine_metrics: dict
    gpu: dict | None = None          # gputime.GpuTime.to_dict(): where the GPU's time went
    page_cache: dict | None = None   # pagecache.resident_share() just before the run


def op_record(rid: int, op, seen_ns: int, h2d_seen_ns: int = 0) -> OpRecord:
    return OpRecord(rid=rid, kind=op.kind, pages=op.num_pages, ok_pages=op.ok_pages,
                    nbytes=op.ok_pages * op.page_bytes, status=op.status,
                    submit_ns=op.submit_ns, first_ns=op.first_ns, done_ns=op.done_ns,
                    seen_ns=seen_ns, io_ns=op.io_ns, gbps=op.gbps,
                    landed_ns=np.asarray(op.landed_ns, dtype=np.int64),
                    worker_of=None if op.worker_of is None else np.asarray(op.worker_of),
                    h2d_seen_ns=h2d_seen_ns)
