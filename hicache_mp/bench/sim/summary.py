"""Per-request results and the benchmark summary, in SGLang's format.

Owns: `RequestResult`, `summarize` (the fields SGLang's bench_long_context /
bench_serving print), and the text formatting
of one run (`format_summary`), of several backends side by side
(`format_comparison`) and the verdict under that table (`format_verdict`). Pure functions: no I/O, no engine calls.

`summarize` keys (times in seconds, lengths in tokens):
  total_requests
  prompt_len_mean, prompt_len_p90, prompt_len_p99
  output_len_mean, output_len_p90, output_len_p99
  ttft_{mean,p90,p99,median,max}_s
  itl_{mean,p90,p99,median,max}_s      pooled over every inter-token gap
  latency_{mean,p90,p99,median,max}_s
  input_token_throughput, output_token_throughput   tokens/s over duration_s
  request_throughput                                requests/s over duration_s
  cache_hit_rate                                    sum(cached) / sum(prompt)

Backend-specific figures (`extra` / comparison rows) use EXTRA_LABELS keys:
  prefetch_gbps_mean, prefetch_gbps_p10, loop_iters_per_s, backup_gbps,
  h2d_after_io_ms_mean (only when pages are loaded to a device),
  gpu_start_s, gpu_wait_prefetch_s, gpu_wait_device_s, loop_late_ms (where
  the simulated GPU's time went: hicache_mp.bench.sim.gputime),
  page_cache_first (share of the first request's stored pages in the page
  cache before the run: hicache_mp.bench.sim.pagecache)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    rid: int
    prompt_len: int
    output_len: int
    cached_len: int
    ttft_s: float
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    ttft_parts: dict | None = None   # ttftparts.PART_NAMES -> s; they sum to ttft_s


EXTRA_LABELS = {
    "prefetch_gbps_mean": "Prefetch GB/s (mean)",
    "prefetch_gbps_p10": "Prefetch GB/s (P10)",
    "loop_iters_per_s": "Scheduler loop it/s",
    "backup_gbps": "Backup GB/s",
    "h2d_after_io_ms_mean": "H2D after last page landed (ms)",
    "gpu_start_s": "GPU idle before first batch (s)",
    "gpu_wait_prefetch_s": "GPU idle, waiting for prefetch (s)",
    "gpu_wait_device_s": "GPU idle, waiting for H2D (s)",
    "loop_late_ms": "Loop late at batch ends (ms, sum)",
    "page_cache_first": "1st request's pages in page cache",
}


def _stats(prefix, values, which):
    # Empty input (e.g. no decode gaps) reports 0 rather than numpy's NaN
    # warnings, so tables stay printable.
    v = np.asarray(values, dtype=float)
    fns = {
        "mean": np.mean,
        "p90": lambda a: np.percentile(a, 90),
        "p99": lambda a: np.percentile(a, 99),
        "median": np.median,
        "max": np.max,
    }
    return {f"{prefix}_{w}{'_s' if prefix in ('ttft', 'itl', 'latency') else ''}":
            float(fns[w](v)) if v.size else 0.0 for w in which}


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """The summary dict described in the module docstring."""
    five = ("mean", "p90", "p99", "median", "max")
    prompt = sum(r.prompt_len for r in results)
    output = sum(r.output_len for r in results)
    out = {"total_requests": len(results)}
    out.update(_stats("prompt_len", [r.prompt_len for r in results], ("mean", "p90", "p99")))
    out.update(_stats("output_len", [r.output_len for r in results], ("mean", "p90", "p99")))
    out.update(_stats("ttft", [r.ttft_s for r in results], five))
    out.update(_stats("itl", [g for r in results for g in r.itl_s], five))
    out.update(_stats("latency", [r.latency_s for r in results], five))
    d = duration_s if duration_s > 0 else float("nan")
    out["input_token_throughput"] = prompt / d
    out["output_token_throughput"] = output / d
    out["request_throughput"] = len(results) / d
    out["cache_hit_rate"] = sum(r.cached_len for r in results) / prompt if prompt else 0.0
    return out


def _fmt(v, digits=2):
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    if v and abs(v) < 0.1:
        return f"{v:.2g}"  # a starved rate (0.004 GB/s) must not print as 0.00
    return f"{v:.{digits}f}"


def format_summary(name: str, summary: dict, extra: dict | None = None) -> str:
    """One run as a bench_serving-style block; `extra` under its own header."""
    w = 40
    lines = [f"{'=' * 12} Serving Benchmark Result ({name}) {'=' * 12}"]

    def row(label, key, digits=2):
        lines.append(f"{label + ':':<{w}}{_fmt(summary.get(key), digits)}")

    def sub(title):
        lines.append(f"{' ' + title + ' ':-^50}")

    row("Total requests", "total_requests")
    for kind in ("prompt_len", "output_len"):
        label = "prompt" if kind == "prompt_len" else "output"
        for stat, text in (("mean", "Average"), ("p90", "P90"), ("p99", "P99")):
            row(f"{text} {label} length", f"{kind}_{stat}")
    row("Input token throughput (tok/s)", "input_token_throughput")
    row("Output token throughput (tok/s)", "output_token_throughput")
    row("Request throughput (req/s)", "request_throughput")
    row("Cache hit rate", "cache_hit_rate", 4)
    for key, title in (("ttft", "Time to First Token"), ("itl", "Inter-Token Latency"),
                       ("latency", "End-to-End Latency")):
        sub(title)
        digits = 4 if key == "itl" else 2
        for stat, text in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"),
                           ("p99", "P99"), ("max", "Max")):
            row(f"{text} {key.upper() if key != 'latency' else 'latency'} (s)",
                f"{key}_{stat}_s", digits)
    if extra:
        sub("Backend")
        for key, value in extra.items():
            lines.append(f"{EXTRA_LABELS.get(key, key) + ':':<{w}}{_fmt(value)}")
    lines.append("=" * 50)
    return "\n".join(lines)


_COLUMNS = (
    ("mean TTFT s", "ttft_mean_s"),
    ("P90 TTFT s", "ttft_p90_s"),
    ("med TTFT s", "ttft_median_s"),
    ("input tok/s", "input_token_throughput"),
    ("req/s", "request_throughput"),
    ("pf GB/s", "prefetch_gbps_mean"),
    ("loop it/s", "loop_iters_per_s"),
    ("backup GB/s", "backup_gbps"),
)


def format_comparison(rows: dict[str, dict], baseline: str) -> str:
    """Backends side by side. Each row is a summary dict merged with its extra
    dict; ratios are mean TTFT over the baseline's and over the best (lowest)."""
    def mean_ttft(name):
        return rows.get(name, {}).get("ttft_mean_s")

    base = mean_ttft(baseline)
    known = [t for t in (mean_ttft(n) for n in rows) if t]
    best = min(known) if known else None
    header = ["backend"] + [c for c, _ in _COLUMNS] + ["TTFT/base", "TTFT/best"]
    table = [header]
    for name, row in rows.items():
        t = row.get("ttft_mean_s")
        cells = [name] + [_fmt(row.get(k)) for _, k in _COLUMNS]
        cells.append(_fmt(t / base) if t is not None and base else "-")
        cells.append(_fmt(t / best) if t is not None and best else "-")
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    out = ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                     for i, c in enumerate(r)) for r in table]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


LEVEL = 1.05   # mean TTFTs closer than this are "level": run-to-run noise on a small box


def format_verdict(rows: dict[str, dict], ours: str = "mp") -> str:
    """One line in words: how much faster (mean TTFT) `ours` is than each other
    storage run of this table; `none` (no storage at all) is the ideal, not a rival."""
    mine = rows.get(ours, {}).get("ttft_mean_s")
    rivals = [n for n in rows if n not in (ours, "none") and rows[n].get("ttft_mean_s")]
    if not mine or not rivals:
        return ""
    def times(r):
        return f"{r:.2f}x" if r < 2 else f"{r:.1f}x"

    parts = []
    for name in rivals:
        r = rows[name]["ttft_mean_s"] / mine
        if r >= LEVEL:
            parts.append(f"{times(r)} faster than {name}")
        elif r > 1 / LEVEL:
            parts.append(f"level with {name} (within {LEVEL - 1:.0%})")
        else:
            parts.append(f"{times(1 / r)} slower than {name}")
    line = f"Verdict (mean TTFT, this run): {ours} is " + ", ".join(parts)
    base = rows.get("none", {}).get("ttft_mean_s")
    if base:
        line += f"; {ours} takes {mine / base:.2f}x the ideal's (none)"
    return line + "."
