"""TTFT parts: where one request's time to first token went, in parts that sum to it.

Owns the names and order of the parts, the reduction of a request's
milestones (seconds from the run's start) to its parts, the mean over a
run's requests, and the breakdown table's text. Must not read the clock or
an engine (the scheduler records the milestones) nor format anything else
(`summary`).

A request's milestones, in the order the reference scheduler passes them:

  admit        the request entered the system (ingest)
  submit       its lookup ended and its prefetch was submitted (or, with no
               hit, it was ready to run)
  first_page   the engine's poll saw its first page land
  landed       ... its last page land
  seen         the loop acted on the finished prefetch (check_prefetch_progress)
  on_device    the loop saw every landed page on the device (DeviceLoader)
  first_batch  its first prefill chunk started on the GPU
  first_token  its last chunk ended and the loop saw it: the first token

Each part is the time from one milestone to the next, with every milestone
first held to [the one before it, first_token]: an event the loop observes
with a fresh clock can sit a few µs after the iteration's clock that starts
a batch, and a cut-short prefetch's last page can land after its request
ran. So the parts are never negative and always sum to the TTFT
(first_token - admit). `prefill` is the first token's own chunks (the GPU's
charged time for the batches that carried the request); `layer_wait` the
time those batches' forwards waited for layers still loading (the mp-direct
run, SGLang's direct L3 path: its requests pass no read milestone before
their first chunk, whose forward overlaps the read; what the read did not
hide is this part); `between_chunks` is the rest of that span: other
requests' batches between its chunks and the loop's lateness at batch ends.
"""
from __future__ import annotations

MILESTONES = ("admit", "submit", "first_page", "landed", "seen", "on_device", "first_batch",
              "first_token")
# (part, what it is): one per step between consecutive milestones, then the
# last span split in two.
PARTS = (
    ("lookup", "admitted -> prefetch submitted (lookup, host slots)"),
    ("first_page", "submitted -> first page landed"),
    ("read", "first page -> last page landed"),
    ("loop_saw", "last page landed -> the loop acted on it"),
    ("h2d", "-> every page seen on the device (H2D left after the read)"),
    ("gpu_queue", "-> its first prefill chunk started (other batches ahead)"),
    ("prefill", "its own prefill chunks on the GPU"),
    ("layer_wait", "its chunks' forwards waiting for layers still loading (mp-direct)"),
    ("between_chunks", "other batches between its chunks, loop lateness"),
)
PART_NAMES = tuple(p for p, _ in PARTS)


def request_parts(marks: dict, own_prefill_s: float, own_wait_s: float = 0.0) -> dict:
    """A request's parts (seconds) from its milestones (`marks`, seconds from the
    run's start; a milestone it never passed, None, counts as the one before it),
    the charged time of the prefill batches that carried it and their waits
    for layers."""
    end = marks["first_token"]
    held, prev = [], marks["admit"]
    for name in MILESTONES:
        t = marks.get(name)
        prev = prev if t is None else min(max(t, prev), end)
        held.append(prev)
    steps = [b - a for a, b in zip(held, held[1:])]
    last = steps.pop()                     # first_batch -> first_token
    prefill = min(max(own_prefill_s, 0.0), last)
    wait = min(max(own_wait_s, 0.0), last - prefill)
    return dict(zip(PART_NAMES, steps + [prefill, wait, last - prefill - wait]))


def mean_parts(per_request: list[dict]) -> dict:
    """The mean of each part over requests (the parts of the mean TTFT)."""
    n = len(per_request)
    return {p: (sum(r[p] for r in per_request) / n if n else 0.0) for p in PART_NAMES}


def format_parts(runs: dict) -> str:
    """One row per run of mean parts in ms, their sum and the mean TTFT beside it;
    `runs` maps a label to its figures' `ttft_parts`."""
    short = {"first_page": "1st page", "loop_saw": "loop saw", "gpu_queue": "GPU queue",
             "layer_wait": "lyr wait", "between_chunks": "between"}
    heads = [short.get(p, p) for p in PART_NAMES]
    w = max(12, max(len(k) for k in runs) + 1) if runs else 12
    lines = ["TTFT breakdown (mean over requests, ms; the parts sum to the mean TTFT):",
             f"{'run':<{w}}" + "".join(f"{h:>10}" for h in heads) + f"{'sum':>10}{'TTFT':>10}"]
    for label, tp in runs.items():
        m = tp["mean_s"]
        lines.append(f"{label:<{w}}" + "".join(f"{m[p] * 1e3:>10.1f}" for p in PART_NAMES)
                     + f"{sum(m.values()) * 1e3:>10.1f}{tp['ttft_mean_s'] * 1e3:>10.1f}")
    lines.append("  " + "; ".join(f"{short.get(p, p)}: {what}" for p, what in PARTS))
    return "\n".join(lines)
