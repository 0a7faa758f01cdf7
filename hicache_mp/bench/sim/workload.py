"""Synthetic LooGLE-like long-context workload (docs/design.md: the reference engine).

Owns: the reference figures (prompt/output length statistics, hit rate,
release rate, compute speeds), the `Request` record with its deterministic
page keys, `make_workload` that builds a request list matching those figures,
`describe` that measures a list, and the `ComputeModel` that turns token
counts into GPU seconds.

Must not: do any I/O, touch storage, or call into the engine. Everything here
is a pure function of its arguments (and the seed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

# --- Figures of the reference workload (SGLang 0.5.10, A100-40GB, Llama-3.1-8B) ---
PROMPT_MEAN = 19723.47
PROMPT_P90 = 27894.0
PROMPT_P99 = 36567.0
OUTPUT_MEAN = 12.5
OUTPUT_P90 = 24.0
OUTPUT_P99 = 55.0
HIT_RATE = 0.8556
NUM_REQUESTS = 32
MAX_IN_FLIGHT = 24
RELEASE_PER_S = 24.0
PAGE_SIZE = 64
PREFILL_TOKENS_PER_S = 11500.0
CHUNK_TOKENS = 6144
DECODE_S_PER_TOKEN = 0.015


@dataclass(frozen=True)
class Request:
    rid: int
    prompt_len: int
    output_len: int
    cached_len: int
    arrival_s: float
    seed: int = 0

    def _chain(self, page_size: int, n_pages: int) -> list[str]:
        # A hash chain mirrors how prefix-cache keys depend on every earlier
        # page; putting rid in each link keeps keys unique across requests.
        prev = f"seed:{self.seed}"
        keys = []
        for i in range(n_pages):
            prev = hashlib.sha256((prev + f"{self.rid}:{i}").encode()).hexdigest()
            keys.append(prev)
        return keys

    def page_keys(self, page_size: int) -> list[str]:
        """Keys of the cached prefix pages (the ones prefetched from storage)."""
        return self._chain(page_size, self.cached_len // page_size)

    def computed_page_keys(self, page_size: int) -> list[str]:
        """Keys of the full pages computed after the prefix (written back)."""
        first = self.cached_len // page_size
        return self._chain(page_size, self.prompt_len // page_size)[first:]


def _quantile_matched(rng, n, mean, p90, p99):
    """n floats whose sample mean, P90 and P99 (numpy linear) hit the targets.

    Stratified lognormal draws give a realistic shape; then the few order
    statistics that numpy's P90/P99 interpolate between are pinned, and the
    body is rescaled to fix the mean. Ordering is preserved throughout.
    """
    # Lognormal sigma from the P99/P90 ratio, mu from the P90.
    z90, z99 = 1.2815516, 2.3263479
    sigma = np.log(p99 / p90) / (z99 - z90)
    mu = np.log(p90) - z90 * sigma
    u = (np.arange(n) + rng.uniform(0.15, 0.85, n)) / n
    z = np.array([NormalDist().inv_cdf(float(x)) for x in u])
    x = np.sort(np.exp(mu + sigma * z))

    def pct_index(q):
        pos = q / 100 * (n - 1)
        lo = int(np.floor(pos))
        return lo, min(lo + 1, n - 1), pos - lo

    lo90, hi90, f90 = pct_index(90)
    lo99, hi99, f99 = pct_index(99)
    # Scale everything so P90 is exact.
    x *= p90 / ((1 - f90) * x[lo90] + f90 * x[hi90])
    # Stretch the part above the P90 pair so P99 is exact, keeping order.
    base = x[hi90]
    cur99 = (1 - f99) * x[lo99] + f99 * x[hi99]
    if cur99 > base:
        x[hi90 + 1:] = base + (x[hi90 + 1:] - base) * (p99 - base) / (cur99 - base)
    # Rescale the body below the P90 pair to fix the mean; clamp to keep order.
    body = slice(0, lo90)
    if lo90 == 0:
        return x   # two requests or fewer: no body below the P90 pair to rescale
    need = mean * n - x[lo90:].sum()
    x[body] *= need / x[body].sum()
    x[body] = np.minimum(x[body], x[lo90])
    return x


def _round_to_total(x, total, minimum):
    """Round to ints >= minimum, then nudge the body so the sum is `total`."""
    r = np.maximum(np.round(x).astype(np.int64), minimum)
    order = np.argsort(r, kind="stable")[: max(1, int(len(r) * 0.8))]
    diff = int(total - r.sum())
    i = 0
    # One unit at a time over the lower 80 %, so the tail quantiles stay put.
    while diff != 0 and i < 100 * len(r) * max(1, abs(diff)):
        j = order[i % len(order)]
        step = 1 if diff > 0 else -1
        if r[j] + step >= minimum:
            r[j] += step
            diff -= step
        i += 1
    return r


def _cached_lens(rng, prompts, page_size, hit_rate):
    """Page-aligned cached lengths, each < prompt, aggregate ~= hit_rate."""
    prompts = np.asarray(prompts, dtype=np.int64)
    frac = hit_rate * rng.uniform(0.96, 1.04, len(prompts))
    want = frac * prompts
    want *= hit_rate * prompts.sum() / want.sum()
    max_pages = (prompts - 1) // page_size  # leaves >= 1 token to compute
    pages = np.minimum(np.floor(want / page_size).astype(np.int64), max_pages)
    # Largest-remainder rounding so the aggregate tracks the target even when
    # pages are a big fraction of a (scaled-down) prompt.
    short = int(round(hit_rate * prompts.sum() / page_size)) - int(pages.sum())
    for j in np.argsort(-(want / page_size - pages), kind="stable"):
        if short <= 0:
            break
        if pages[j] < max_pages[j]:
            pages[j] += 1
            short -= 1
    return pages * page_size


def make_workload(num_requests: int = NUM_REQUESTS, seed: int = 0,
                  scale: float = 1.0, page_size: int = PAGE_SIZE) -> list[Request]:
    """Requests whose prompt/output statistics and hit rate match the figures above.

    `scale` multiplies prompt lengths (quick runs); proportions and the hit
    rate are kept. Arrivals are FIFO at RELEASE_PER_S.
    """
    rng = np.random.default_rng(seed)
    n = num_requests
    prompt_f = _quantile_matched(rng, n, PROMPT_MEAN, PROMPT_P90, PROMPT_P99) * scale
    min_prompt = 2 * page_size
    prompts = _round_to_total(prompt_f, round(PROMPT_MEAN * scale * n), min_prompt)
    output_f = _quantile_matched(rng, n, OUTPUT_MEAN, OUTPUT_P90, OUTPUT_P99)
    outputs = _round_to_total(output_f, round(OUTPUT_MEAN * n), 1)
    # Shuffle so long prompts are not all at the end of the FIFO.
    prompts = prompts[rng.permutation(n)]
    outputs = outputs[rng.permutation(n)]
    cached = _cached_lens(rng, prompts, page_size, HIT_RATE)
    return [
        Request(rid=i, prompt_len=int(prompts[i]), output_len=int(outputs[i]),
                cached_len=int(cached[i]), arrival_s=i / RELEASE_PER_S, seed=seed)
        for i in range(n)
    ]


def describe(requests: list[Request]) -> dict:
    """Mean/P90/P99 of prompt and output lengths, and the aggregate hit rate."""
    p = np.array([r.prompt_len for r in requests], dtype=float)
    o = np.array([r.output_len for r in requests], dtype=float)
    c = np.array([r.cached_len for r in requests], dtype=float)
    return {
        "num_requests": len(requests),
        "prompt_len_mean": float(p.mean()),
        "prompt_len_p90": float(np.percentile(p, 90)),
        "prompt_len_p99": float(np.percentile(p, 99)),
        "output_len_mean": float(o.mean()),
        "output_len_p90": float(np.percentile(o, 90)),
        "output_len_p99": float(np.percentile(o, 99)),
        "hit_rate": float(c.sum() / p.sum()),
    }


@dataclass
class ComputeModel:
    """GPU time for prefill and decode; time_scale shrinks it for quick runs."""
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    chunk_tokens: int = CHUNK_TOKENS
    decode_s_per_token: float = DECODE_S_PER_TOKEN
    time_scale: float = 1.0

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s * self.time_scale

    def decode_s(self, steps: int) -> float:
        return steps * self.decode_s_per_token * self.time_scale
