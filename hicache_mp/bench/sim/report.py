"""The bench's report: each run's figures, the comparison of runs, and merging reports.

Owns what the JSON report says of a run (`figures`: the summary, per-op
rates and statuses, engine counters, the GPU's account, per request, the
mean TTFT's parts), the
comparison of mean TTFTs, the rows `summary.format_comparison` takes, the
busy-machine note, the report schema, and merging reports of one workload
made in separate calls. Must not run anything (`bench` does) or format text
(`summary`).
"""
from __future__ import annotations

import os

import numpy as np

from .gputime import gpu_figures
from .records import RunResult
from .summary import summarize
from .ttftparts import mean_parts

SCHEMA = "hicache_mp.bench/1"


def _mean(values):
    return float(np.mean(values)) if len(values) else None


def op_stats(records) -> dict:
    rates = [r.gbps for r in records if r.gbps is not None and r.ok_pages]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "ops": len(records),
        "pages": int(sum(r.pages for r in records)),
        "ok_pages": int(sum(r.ok_pages for r in records)),
        "bytes": int(sum(r.nbytes for r in records)),
        "gbps_mean": _mean(rates),
        "gbps_p10": float(np.percentile(rates, 10)) if rates else None,
        "gbps_per_op": [round(x, 4) for x in rates],
        "seconds_mean": _mean([(r.done_ns - r.submit_ns) / 1e9 for r in records]),
        "statuses": statuses,
    }


def figures(res: RunResult, page_size: int) -> dict:
    """Every figure of one run (one entry of the report's `runs`)."""
    summary = summarize(res.requests, res.duration_s)
    prefetch, backup = op_stats(res.prefetch), op_stats(res.backups)
    m = res.engine_metrics
    h2d = [(r.h2d_seen_ns - r.done_ns) / 1e6 for r in res.prefetch if r.h2d_seen_ns and r.done_ns]
    gpu = gpu_figures(res)
    extra = {
        "prefetch_gbps_mean": prefetch["gbps_mean"],
        "h2d_after_io_ms_mean": _mean(h2d),
        "prefetch_gbps_p10": prefetch["gbps_p10"],
        "loop_iters_per_s": res.loop_iters / res.duration_s if res.duration_s else None,
        "backup_gbps": backup["gbps_mean"],
        "gpu_start_s": gpu.get("start_s"),
        "gpu_wait_prefetch_s": gpu.get("wait_s", {}).get("prefetch"),
        "gpu_wait_device_s": gpu.get("wait_s", {}).get("device"),
        "loop_late_ms": gpu["late_s"] * 1e3 if "late_s" in gpu else None,
        "page_cache_first": (res.page_cache or {}).get("first_request"),
    }
    return {
        "backend": res.backend, "policy": res.policy, "yield_ms": res.yield_ms,
        "duration_s": res.duration_s, "loop_iters": res.loop_iters,
        "summary": summary, "extra": extra,
        "prefetch": prefetch, "backup": {**backup, "skipped_pages": res.backup_skipped_pages},
        "verify": {"pages_checked": res.verified_pages + len(res.verify_failures),
                   "failures": res.verify_failures},
        "host_slots_low_water": res.slots_low_water,
        "engine": {k: m.get(k) for k in ("workers", "read_gbps", "write_gbps", "read_bytes",
                                         "write_bytes", "worker_busy", "misses", "poll_calls",
                                         "respawns", "cpu") if k in m},
        "requests": [
            {"rid": r.rid, "prompt_len": r.prompt_len, "output_len": r.output_len,
             "cached_len": r.cached_len, "ttft_s": r.ttft_s, "latency_s": r.latency_s,
             "itl_s": r.itl_s, "ttft_parts": r.ttft_parts}
            for r in res.requests],
        "ttft_parts": {"mean_s": mean_parts([r.ttft_parts for r in res.requests]),
                       "ttft_mean_s": summary["ttft_mean_s"]},
        "batches": {"prefill": sum(1 for b in res.batches if b[0] == "prefill"),
                    "decode": sum(1 for b in res.batches if b[0] == "decode")},
        "gpu": gpu,
        "page_cache": res.page_cache,
    }


def comparison(runs: dict) -> dict:
    """Mean TTFT of each run over the ideal (`none`) and over the best run."""
    base = runs.get("none", {}).get("summary", {}).get("ttft_mean_s")
    means = {k: v["summary"]["ttft_mean_s"] for k, v in runs.items()}
    best = min(means.values()) if means else None
    return {
        "baseline": "none" if base else None,
        "best": min(means, key=means.get) if means else None,
        "ttft_mean_over_baseline": {k: (t / base if base else None) for k, t in means.items()},
        "ttft_mean_over_best": {k: (t / best if best else None) for k, t in means.items()},
    }


def table_rows(runs: dict) -> dict:
    """What `format_comparison` takes: each run's summary merged with its extras."""
    return {k: {**v["summary"], **v["extra"]} for k, v in runs.items()}


def busy_machine_note(runs: dict, cpus: int | None = None) -> str:
    """A warning when a run shared an oversubscribed machine, or ""."""
    cpus = cpus or os.cpu_count() or 1
    # Only the in-process baselines' runs count: there the bench itself keeps
    # about two threads busy (the loop and a reader), hence the +1; an mp run's
    # own workers would raise the load without hiding anything.
    peak = max((max(v.get("load_avg") or [0]) for v in runs.values()
                if v.get("backend") in ("file", "fast_file")), default=0)
    if peak <= cpus + 1:
        return ""
    return (f"Note: this machine was busy (1-minute load average up to {peak:.1f} on {cpus} "
            f"CPUs). The in-process baselines are starved of the GIL only while the scheduler "
            f"thread has a CPU to take it back at once, as on a serving host; with every CPU "
            f"busy they look faster than they are. Re-run on a quiet machine for the real gap.")


# The config keys that define the workload and what a run measures: reports that
# differ in any of them do not belong in one table.
SAME_WORKLOAD = ("num_requests", "seed", "quick", "page_size", "layout", "dtype", "policy",
                 "timeout_s", "prompt_scale", "time_scale", "geometry", "device_load")


def merge_reports(reports: list[dict]) -> dict:
    """One report from several of the same workload (each run in its own call):
    their runs side by side, in the order given, and the comparison recomputed."""
    if not reports:
        raise ValueError("nothing to merge")
    first = reports[0]
    runs: dict = {}
    for rep in reports:
        if rep.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} report: schema {rep.get('schema')!r}")
        for key in SAME_WORKLOAD:
            if rep["config"].get(key) != first["config"].get(key):
                raise ValueError(f"reports differ in {key}: {first['config'].get(key)!r} vs "
                                 f"{rep['config'].get(key)!r}; they are not one workload")
        for label, run in rep["runs"].items():
            if label in runs:
                raise ValueError(f"run {label!r} is in more than one report")
            runs[label] = run
    merged = {**first, "runs": runs, "merged_from": [r.get("created") for r in reports],
              "warmup": [r.get("warmup") for r in reports]}
    merged["config"] = {**first["config"], "runs": list(runs)}
    merged["comparison"] = comparison(runs)
    return merged
