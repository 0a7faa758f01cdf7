"""Where a prefetch's time goes: per-op breakdown and a Chrome-trace timeline of one run.

Owns turning a `RunResult` into (a) per-op phases, the counterpart of the
alloc/io/copy lines in SGLang's log, (b) a text table, and (c) a trace that
chrome://tracing and Perfetto open. Must not run anything: pure functions of
the records the scheduler kept.

Phases of a prefetch op, from what the engine records (page landing times are
stamped when `poll()` drains the completion, I/O time by the reader):
  queue_ms  submit -> first page landed, less one mean page I/O time: the wait
            before any reader started on the op (GIL starvation shows here
            for `file`, ring depth for `mp`);
  io_ms     summed per-page read time (reader-seconds; over the wall time it
            is the op's parallelism);
  drain_ms  first page landed -> last page landed;
  seen_ms   last page landed -> the scheduler acted on the op (policy check);
  h2d_ms    last page landed -> every landed page seen on the device (0 when
            pages are not loaded to a device: --device-load off).
"""
from __future__ import annotations

import numpy as np

PHASES = ("queue_ms", "io_ms", "drain_ms", "seen_ms", "h2d_ms", "wall_ms")


def op_breakdown(records) -> list[dict]:
    rows = []
    for r in records:
        if not r.pages or not r.first_ns:
            continue
        mean_io = r.io_ns / r.pages
        rows.append({
            "rid": r.rid, "pages": r.pages, "ok_pages": r.ok_pages, "status": r.status,
            "mb": r.nbytes / 1e6, "gbps": r.gbps,
            "queue_ms": max(0.0, (r.first_ns - r.submit_ns - mean_io) / 1e6),
            "io_ms": r.io_ns / 1e6,
            "drain_ms": (r.done_ns - r.first_ns) / 1e6,
            "seen_ms": max(0.0, (r.seen_ns - r.done_ns) / 1e6) if r.seen_ns else 0.0,
            "h2d_ms": max(0.0, (r.h2d_seen_ns - r.done_ns) / 1e6) if r.h2d_seen_ns else 0.0,
            "wall_ms": (r.done_ns - r.submit_ns) / 1e6,
        })
    return rows


def phase_stats(rows: list[dict]) -> dict:
    """Mean, P50 and P90 of each phase over the ops."""
    out = {}
    for phase in PHASES:
        v = np.array([r[phase] for r in rows], dtype=float)
        out[phase] = ({"mean": float(v.mean()), "p50": float(np.median(v)),
                       "p90": float(np.percentile(v, 90))} if v.size else {})
    return out


def format_breakdown(rows: list[dict], limit: int = 40) -> str:
    head = f"{'rid':>4} {'pages':>6} {'MB':>8} {'status':>8} {'queue ms':>10} {'io ms':>10} " \
           f"{'drain ms':>10} {'seen ms':>10} {'h2d ms':>10} {'wall ms':>10} {'GB/s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows[:limit]:
        lines.append(f"{r['rid']:>4} {r['pages']:>6} {r['mb']:>8.1f} {r['status']:>8} "
                     f"{r['queue_ms']:>10.2f} {r['io_ms']:>10.2f} {r['drain_ms']:>10.2f} "
                     f"{r['seen_ms']:>10.3f} {r['h2d_ms']:>10.2f} {r['wall_ms']:>10.2f} "
                     f"{r['gbps'] or 0:>7.2f}")
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more ops")
    stats = phase_stats(rows)
    for stat in ("mean", "p50", "p90"):
        cells = " ".join(f"{stats[p].get(stat, 0):>10.2f}" for p in PHASES)
        lines.append(f"{stat:>29} {cells}")
    return "\n".join(lines)


def chrome_trace(res, worker_names: list[str] | None = None) -> dict:
    """The run as Chrome trace events (ts/dur in microseconds from the run's start)."""
    t0 = res.t0_ns

    def us(ns):
        return (ns - t0) / 1e3

    ev = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"scheduler ({res.name})"}},
          {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "GPU batches"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "I/O (pages landed)"}}]
    for kind, start, end, tokens, nreq in res.batches:
        ev.append({"ph": "X", "pid": 1, "tid": 1, "name": kind, "ts": start * 1e6,
                   "dur": (end - start) * 1e6, "args": {"tokens": tokens, "requests": nreq}})
    named = set()
    for rec in list(res.prefetch) + list(res.backups):
        # One row per request and direction: a request's ops never overlap there.
        tid = (1000 if rec.kind == "read" else 2000) + rec.rid
        if tid not in named:
            named.add(tid)
            ev.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name",
                       "args": {"name": f"r{rec.rid} {'prefetch' if rec.kind == 'read' else 'backup'}"}})
        ev.append({"ph": "X", "pid": 1, "tid": tid, "name": f"{rec.kind} r{rec.rid}",
                   "ts": us(rec.submit_ns), "dur": (rec.done_ns - rec.submit_ns) / 1e3,
                   "args": {"pages": rec.pages, "ok_pages": rec.ok_pages, "status": rec.status,
                            "gbps": rec.gbps, "io_ms": rec.io_ns / 1e6}})
        if rec.seen_ns > rec.done_ns:
            ev.append({"ph": "X", "pid": 1, "tid": tid, "name": "until scheduler saw it",
                       "ts": us(rec.done_ns), "dur": (rec.seen_ns - rec.done_ns) / 1e3})
        for pos, landed in enumerate(rec.landed_ns.tolist()):
            if not landed:
                continue
            worker = int(rec.worker_of[pos]) if rec.worker_of is not None else 0
            ev.append({"ph": "i", "s": "t", "pid": 2, "tid": worker, "ts": us(landed),
                       "name": f"{rec.kind} r{rec.rid} p{pos}"})
    workers = sorted({e["tid"] for e in ev if e.get("pid") == 2 and e["ph"] == "i"})
    for w in workers:
        name = (worker_names or [])[w] if worker_names and w < len(worker_names) else f"worker {w}"
        ev.append({"ph": "M", "pid": 2, "tid": w, "name": "thread_name", "args": {"name": name}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"run": res.name, "backend": res.backend, "policy": res.policy}}
