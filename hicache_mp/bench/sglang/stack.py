"""Real-stack harness: hicache_mp behind SGLang 0.5.23's own controller.

Drives SGLang's real host pool (`MHATokenToKVPoolHost` on the "shm"
allocator, cudaHostRegister'ed on a GPU box) and its real `HiCacheController`
storage threads (prefetch, I/O, sync, backup), with the backend built by
SGLang's `StorageBackendFactory` (so its failure injector wraps it when its
env vars are set). The scheduler thread's part is played by this process's
main thread, exactly as SGLang's scheduler does it: `controller.prefetch`,
drain `prefetch_hit_queue`, allocate host slots, `prefetch_buffer.put`, drain
`ack_prefetch_queue`; backups via `write_storage` and `ack_backup_queue`.

Backends: `mp` (hicache_mp via the dynamic config), `file` (SGLang's
HiCacheFile), `nobytes` (moves nothing: SGLang's own hand-off floor). With
`--sleep-floor`, a second floor beside mp's rounds: `Sleeping` moves nothing
but sleeps once per batch_get_v1 (GIL released) for as long as mp's batch
took idle in that run, the floor of any backend that waits once per batch.
Scheduler: `idle` blocks on the queues; `busy` runs pure Python (holds the
GIL, like a scheduler building batches) and polls the queues between chunks.

Prints and writes (--json) per backend: round times and GB/s per mode
(medians of --runs), busy/idle ratios, the busy loop's it/s, the batch_get_v1
/ batch_set_v1 call counts, and 0 wrong bytes. The read-while-a-backup round
(a backup of new pages, 1 ms later the prefetch) is given against the idle
median and against the same prefetch alone just before it, with the engine's
sleeps and the backup pages written while the prefetch ran. Owns no engine
logic.

    python3 scripts/sglang_stack.py --round-mib 2048 --page-mib 8 --runs 5 \
        --json $OUT/stack.json
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

from hicache_mp.bench.giltrace import GilTracer, NullTracer, table as trace_table
from hicache_mp.bench.loop import QUEUE_POLL_ITERS, lcg
from hicache_mp.bench.sglang import real as R

_rid = itertools.count()


# A chunk of the busy loop takes ~10-20 us; one that took longer than this
# lost the GIL to another thread of the process (SGLang's storage threads,
# the backend) that then held it that long. Shorter holds are not seen here:
# what a storage thread loses waiting to get the GIL back shows on its side
# (scripts/sglang_hybrid_check.py counts its blocks, decision 57).
HANDOFF_GAP_S = 0.0005


class Scheduler:
    """The scheduler thread's part: waits on SGLang's queues, idle or busy.

    Busy, it also counts stalls: every gap between two chunks of its loop
    longer than HANDOFF_GAP_S is a time another thread of the process held
    the GIL that long."""

    def __init__(self, busy: bool, poll_every: int = QUEUE_POLL_ITERS):
        self.busy, self.poll_every = busy, poll_every
        self.iters, self.x = 0, 1
        self.busy_s = 0.0
        self.handoffs, self.handoff_s = 0, 0.0
        self._last = None

    def spin(self, n: int) -> None:
        self.x = lcg(self.x, n)
        self.iters += n
        now = time.perf_counter()
        # since the previous chunk ended: this chunk plus one queue poll
        if self._last is not None and now - self._last > HANDOFF_GAP_S:
            self.handoffs += 1
            self.handoff_s += now - self._last
        self._last = now

    def get(self, q, deadline: float):
        """One item from `q`; TimeoutError past `deadline` (never a hang)."""
        import queue
        if not self.busy:
            left = deadline - time.monotonic()
            try:
                return q.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise TimeoutError("no answer from SGLang's storage threads") from None
        t0 = time.perf_counter()
        self._last = None  # gaps between polls of different queues are no hand-offs
        try:
            while True:
                try:
                    return q.get_nowait()
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise TimeoutError("no answer from SGLang's storage threads") from None
                    self.spin(self.poll_every)
        finally:
            self.busy_s += time.perf_counter() - t0

    def rate(self) -> float:
        return self.iters / self.busy_s if self.busy_s > 0 else 0.0


def loop_rate_alone(seconds: float = 0.5) -> float:
    s = Scheduler(True)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s.spin(s.poll_every)
    return s.iters / (time.perf_counter() - t0)


# --- one round through SGLang's controller ----------------------------------------
def backup(ctl, host_indices, tokens, hashes, sched, timeout_s):
    t0 = time.perf_counter()
    op_id = ctl.write_storage(host_indices, tokens, hash_value=hashes)
    op = sched.get(ctl.ack_backup_queue, time.monotonic() + timeout_s)
    assert op.id == op_id
    return time.perf_counter() - t0, op.completed_tokens


def prefetch(ctl, host_pool, parts, sched, timeout_s):
    """One round: every request of `parts` ([(tokens, last_hash)]) submitted at
    once, as a scheduler admits several waiting requests, then each one's hit
    answered (host slots allocated, handed to the I/O thread) as it comes and
    every ack drained until each request is complete.
    (seconds, [tokens completed], [host indices or None]) per request."""
    deadline = time.monotonic() + timeout_s
    t0 = time.perf_counter()
    ops = [ctl.prefetch(f"r{next(_rid)}", tokens, last_hash) for tokens, last_hash in parts]
    at = {op.request_id: i for i, op in enumerate(ops)}
    done, idx = [0] * len(ops), [None] * len(ops)
    open_ = len(ops)
    for _ in ops:
        got = sched.get(ctl.prefetch_hit_queue, deadline)
        i = at[got.request_id]
        n = got.storage_hit_count
        idx[i] = host_pool.alloc(n) if n else None
        if idx[i] is None:
            open_ -= 1
            continue
        got.host_indices = idx[i]
        ctl.prefetch_buffer.put(got)
    while open_:
        ack = sched.get(ctl.ack_prefetch_queue, deadline)
        i = at[ack.rid]
        if ack.completed_req:
            open_ -= 1
        elif ack.completed_tokens is not None:
            done[i] = ack.completed_tokens
    return time.perf_counter() - t0, done, idx


# --- the stack for one backend -----------------------------------------------------
class Stack:
    """A real host pool and controller on one backend; pages of random bytes
    in `src` slots are the truth every read is checked against."""

    def __init__(self, sgl, backend: str, args, store: str, *, tp_rank=0, tp_size=1,
                 tp_group=None):
        self.sgl, self.name, self.args = sgl, backend, args
        self.P = args.page_size
        self.pages = args.file_round_pages if backend == "file" else args.round_pages
        # src pages, read-back pages, plus a second set for write-during-read
        self.hp = R.mha_host_pool(sgl, layers=args.layers, heads=args.heads,
                                  head_dim=args.head_dim, page_size=self.P,
                                  pages=self.pages * 3, layout=args.layout)
        if backend == "mp":
            kind, extra = "dynamic", R.mp_extra(store, num_workers=args.workers,
                                                **getattr(args, "mp_key", {}))
            if getattr(args, "node_engines", 0):
                extra["node_engines"] = args.node_engines
        elif backend == "file":
            kind, extra = "file", {"file_storage_path": store}
        elif backend == "nobytes":
            kind, extra = "dynamic", R.nobytes_extra()
        elif backend == "sleeping":
            kind, extra = "dynamic", R.nobytes_extra("Sleeping", "sleeping")
        else:
            raise ValueError(f"unknown backend {backend!r} (mp, file, nobytes, sleeping)")
        self.ctl = R.controller(sgl, self.hp, backend=kind, extra=extra, tp_rank=tp_rank,
                                tp_size=tp_size, tp_group=tp_group)
        self.calls = _count_calls(self.ctl)
        self.src = self.hp.alloc(self.pages * self.P)
        self.extra_src = self.hp.alloc(self.pages * self.P)
        import torch
        g = torch.Generator().manual_seed(7)
        buf = self.hp.kv_buffer.view(torch.uint8).view(-1)
        # random_ over int64 words: 3-4x faster than randint over bytes (6 GiB per
        # rank at 2 GiB rounds; several ranks fill at once in sglang_ranks)
        for a in range(0, buf.numel() - buf.numel() % 8, 1 << 28):
            chunk = buf[a:a + (1 << 28)]
            chunk[:chunk.numel() - chunk.numel() % 8].view(torch.int64).random_(generator=g)
        self.tokens = list(range(1, self.pages * self.P + 1))
        self.hashes = sgl.get_storage_hash_str(self.tokens, None, page_size=self.P)
        self.wrong_pages = 0
        self.checked_pages = 0

    def page(self, idx, i):
        """Page i of `idx` as bytes (random bf16 bytes hold NaNs: compare bytes)."""
        import torch
        return self.hp.get_data_page(int(idx[i * self.P]), flat=True).contiguous().view(torch.uint8)

    def check(self, idx, done_tokens, first_page=0) -> None:
        """Compare the pages read into `idx` with src pages from `first_page` on."""
        if self.name in ("nobytes", "sleeping") or idx is None:
            return
        import torch
        for i in range(done_tokens // self.P):
            self.checked_pages += 1
            if not torch.equal(self.page(idx, i), self.page(self.src, first_page + i)):
                self.wrong_pages += 1

    def parts(self):
        """The round's requests: the backed-up sequence cut into `--requests`
        prefixes of their own (each carries the hash chain's last hash before it)."""
        n = max(1, self.pages // max(1, self.args.requests))
        cuts = list(range(0, self.pages, n))
        return [(self.tokens[c * self.P:min(c + n, self.pages) * self.P],
                 self.hashes[c - 1] if c else None, c) for c in cuts]

    def read(self, sched, *, check=True):
        """(seconds, tokens completed over all requests)."""
        parts = self.parts()
        t, done, idx = prefetch(self.ctl, self.hp, [(tk, lh) for tk, lh, _ in parts], sched,
                                self.args.timeout_s)
        for (_, _, first), d, x in zip(parts, done, idx):
            if x is not None:
                if check:
                    self.check(x, d, first)
                self.hp.free(x)
        return t, sum(done)

    def close(self):
        with contextlib.suppress(Exception):
            self.ctl._stop_storage_threads()
        be = backend_of(self.ctl)
        if hasattr(be, "close"):
            be.close()
        # SGLang's own teardown of a pinned pool (cudaHostUnregister): a pool
        # freed still registered lets the next one be mapped at its address,
        # and registering that range again fails (cudaError 712, "resource
        # already mapped": the H200 fastpath run's trace, after its stacks closed).
        with contextlib.suppress(Exception):
            self.hp.destroy()
        for fd in getattr(self.hp.allocator, "fds", []):
            with contextlib.suppress(OSError):
                os.close(fd)
        if hasattr(self.hp.allocator, "fds"):
            self.hp.allocator.fds = []
        self.hp.kv_buffer = None


def backend_of(ctl):
    """The backend behind SGLang's controller (under its failure injector too)."""
    be = ctl.storage_backend
    return getattr(be, "_backend", be)


def _wakeups(s: Stack):
    """(posted, timed out, stale, leftover) sleeps of hicache_mp's engine so
    far (leftover: posts taken before a sleep, never slept on); None for others."""
    eng = getattr(backend_of(s.ctl), "engine", None)
    if eng is None:
        return None
    m = eng.metrics()
    return (m.get("wait_wakeups_posted", 0), m.get("wait_wakeups_timeout", 0),
            m.get("wait_wakeups_stale", 0),
            m.get("wait_leftover_posts_taken", 0),
            m.get("wait_woken_ahead", 0), m.get("wait_spins", 0))


def _pages_done(s: Stack):
    """Pages hicache_mp's workers finished so far (reads and writes); None for others."""
    eng = getattr(backend_of(s.ctl), "engine", None)
    return None if eng is None else sum(eng.metrics()["worker_pages"])


def _count_calls(ctl) -> dict:
    """Counts the backend calls SGLang's threads make (batch_get_v1 etc.)."""
    counts = {"batch_exists": 0, "batch_get_v1": 0, "batch_set_v1": 0, "batch_get": 0,
              "batch_set": 0}
    be = ctl.storage_backend
    for name in counts:
        fn = getattr(be, name, None)
        if fn is None:
            continue

        def wrap(*a, _fn=fn, _name=name, **k):
            counts[_name] += 1
            return _fn(*a, **k)
        setattr(be, name, wrap)
    return counts


def median(xs):
    return statistics.median(xs) if xs else None


TRACE = NullTracer()  # GilTracer() once main() installs it (--trace)


def run_backend(sgl, backend, args, root, floor: "Stack | None" = None,
                sleeper: "Stack | None" = None) -> dict:
    """One backend's rounds. `floor`: a no-bytes stack whose round of the same
    mode runs right after each of this backend's, so the floor is measured in
    the same minutes (the box's speed drifts between runs of a few seconds).
    `sleeper`: the sleeping floor, likewise, after the no-bytes one; each run
    its sleep is this backend's idle batch time of that run."""
    store = os.path.join(root, backend)
    os.makedirs(store, exist_ok=True)
    s = Stack(sgl, backend, args, store)
    gb = s.pages * s.hp.get_size_per_token() * s.P / 1e9
    out = {"backend": backend, "round_gb": gb, "pages": s.pages}
    try:
        t, done = backup(s.ctl, s.src, s.tokens, s.hashes, Scheduler(False), args.timeout_s)[:2]
        out["write_s"], out["write_gbps"] = t, gb / t
        out["write_ok"] = done == len(s.tokens)
        s.read(Scheduler(False))  # warm: first round pays the index/page cache
        for st in (floor, sleeper):   # and the floors' first rounds their first calls
            if st is not None:
                st.read(Scheduler(False))
        w0, c0 = _wakeups(s), s.calls["batch_get_v1"]
        modes = {"idle": [], "busy": []}
        rates, handoffs = [], []
        if args.switch_interval_ms:
            modes["busy_switch"] = []
        for _ in range(args.runs):
            for mode in modes:
                sched = Scheduler(mode != "idle")
                old = sys.getswitchinterval()
                if mode == "busy_switch":
                    sys.setswitchinterval(args.switch_interval_ms / 1000)
                gets0 = s.calls["batch_get_v1"]
                try:
                    with TRACE.round(f"{backend}:{mode}"):
                        t, done = s.read(sched)
                finally:
                    sys.setswitchinterval(old)
                gets = s.calls["batch_get_v1"] - gets0
                if done != len(s.tokens):
                    out.setdefault("short_reads", 0)
                    out["short_reads"] = out["short_reads"] + 1
                modes[mode].append(t)
                if floor is not None and mode in ("idle", "busy"):
                    # the no-bytes floor's round of the same mode, right after this one
                    fs = Scheduler(mode == "busy")
                    with TRACE.round(f"nobytes-floor:{mode}"):
                        out.setdefault(f"floor_{mode}_s", []).append(floor.read(fs)[0])
                    if mode == "busy":
                        out.setdefault("floor_loop_rate", []).append(fs.rate())
                if sleeper is not None and mode in ("idle", "busy"):
                    if mode == "idle":  # as long as mp's idle batch of this run
                        f_idle = out["floor_idle_s"][-1] if floor is not None else 0.0
                        out.setdefault("sleep_floor_sleep_s", []).append(
                            backend_of(sleeper.ctl).sleep_like(t, f_idle, gets))
                    ss = Scheduler(mode == "busy")
                    with TRACE.round(f"sleep-floor:{mode}"):
                        out.setdefault(f"sleep_floor_{mode}_s", []).append(sleeper.read(ss)[0])
                    if mode == "busy":
                        out.setdefault("sleep_floor_loop_rate", []).append(ss.rate())
                if mode == "busy":
                    rates.append(sched.rate())
                    handoffs.append((sched.handoffs, sched.handoff_s))
                elif mode == "busy_switch":
                    out.setdefault("loop_rate_switch", []).append(sched.rate())
        w1, calls = _wakeups(s), s.calls["batch_get_v1"] - c0  # the timed rounds' only
        if args.trace and args.trace_runs:
            # traced rounds after the timed ones: the tracer's own Python on
            # SGLang's threads stays out of the timings
            TRACE.arm()
            for _ in range(args.trace_runs):
                for mode in ("idle", "busy"):
                    with TRACE.round(f"{backend}:{mode}"):
                        s.read(Scheduler(mode == "busy"))
                    if floor is not None:
                        with TRACE.round(f"nobytes-floor:{mode}"):
                            floor.read(Scheduler(mode == "busy"))
                    if sleeper is not None:
                        with TRACE.round(f"sleep-floor:{mode}"):
                            sleeper.read(Scheduler(mode == "busy"))
            TRACE.disarm()
        for mode, ts in modes.items():
            out[f"{mode}_s"] = ts
            out[f"{mode}_median_s"] = median(ts)
            out[f"{mode}_gbps"] = gb / median(ts)
        if w0 is not None and calls:
            # the engine's sleeps per batch: each gives up and takes back the GIL
            out["wakeups_per_batch_get"] = {"posted": (w1[0] - w0[0]) / calls,
                                            "timeout_5ms": (w1[1] - w0[1]) / calls,
                                            "stale": (w1[2] - w0[2]) / calls,
                                            "leftover_taken": (w1[3] - w0[3]) / calls,
                                            # waiters note 9: posted ahead of the batch's end
                                            "woken_ahead": (w1[4] - w0[4]) / calls,
                                            "spins": (w1[5] - w0[5]) / calls}
        out["busy_over_idle"] = out["busy_median_s"] and out["idle_median_s"] / out["busy_median_s"]
        out["loop_rate_busy"] = median(rates)
        if calls and args.runs:  # batch_get_v1 calls per read round (the warm-up not counted)
            out["batch_get_per_round"] = calls / (args.runs * len(modes))
        out["handoffs_per_round"] = median([h for h, _ in handoffs])
        out["handoff_s_per_round"] = median([t for _, t in handoffs])
        for k in ("loop_rate_switch",):
            if k in out:
                out[k] = median(out[k])
        if backend != "nobytes" and args.mixed:
            rounds = [read_during_write(s, args, r) for r in range(args.runs)]
            out["read_with_write_runs_s"] = [x["read_with_write_s"] for x in rounds]
            out["read_with_write_s"] = median(out["read_with_write_runs_s"])
            out["read_with_write_over_paired"] = median(
                [x["read_alone_s"] / x["read_with_write_s"] for x in rounds])
            for k in ("read_with_write_ok", "write_during_read_ok"):
                out[k] = all(x[k] for x in rounds)
            if all("wakeups" in x for x in rounds):
                out["read_with_write_wakeups"] = {
                    "posted": median([x["wakeups"][0] for x in rounds]),
                    "timeout_5ms": median([x["wakeups"][1] for x in rounds])}
                out["written_during_read"] = median([x["written"] for x in rounds])
        out["calls"] = dict(s.calls)
        out["wrong_pages"], out["checked_pages"] = s.wrong_pages, s.checked_pages
    finally:
        s.close()
    return out


def read_during_write(s: Stack, args, r: int = 0) -> dict:
    """A prefetch round while a backup of other pages (new ones each round `r`) is in
    flight, right after the same prefetch alone (`read_alone_s`: a pair, so the
    ratio does not move with the box between the idle rounds and these)."""
    import threading
    alone, _ = s.read(Scheduler(False), check=False)  # the same pages the other rounds check
    first = 10**7 + r * s.pages * s.P
    tokens = list(range(first, first + s.pages * s.P))
    hashes = s.sgl.get_storage_hash_str(tokens, None, page_size=s.P)
    w0, p0 = _wakeups(s), _pages_done(s)
    s.ctl.write_storage(s.extra_src, tokens, hash_value=hashes)
    time.sleep(0.001)
    t, done = s.read(Scheduler(False))
    w1, p1 = _wakeups(s), _pages_done(s)
    # the backup's ack comes back on the queue the scheduler drains
    op = Scheduler(False).get(s.ctl.ack_backup_queue, time.monotonic() + args.timeout_s)
    del threading
    out = {"read_with_write_s": t, "read_alone_s": alone, "read_with_write_ok": done == len(s.tokens),
           "write_during_read_ok": op.completed_tokens == len(tokens)}
    if w0 is not None:
        # the engine's sleeps while the prefetch ran (SGLang's backup thread waits too)
        out["wakeups"] = (w1[0] - w0[0], w1[1] - w0[1])
        # backup pages written from write_storage to the prefetch's end: what the
        # reads shared the workers with
        out["written"] = p1 - p0 - done // s.P
    return out


def injector_run(sgl, args, root) -> dict:
    """mp under SGLang's HiCacheStorageFailureInjector: every round ends (no
    hang), a short read is a leading prefix, and every page it reports is exact."""
    keys = {"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": str(args.inject_failure),
            "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": str(args.inject_delay)}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        store = os.path.join(root, "mp-injected")
        os.makedirs(store, exist_ok=True)
        s = Stack(sgl, "mp", args, store)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    out = {"wrapped": type(s.ctl.storage_backend).__name__}
    try:
        writes, reads = [], []
        for _ in range(args.inject_rounds):
            writes.append(backup(s.ctl, s.src, s.tokens, s.hashes, Scheduler(False),
                                 args.timeout_s)[1])
            reads.append(s.read(Scheduler(True))[1])
        out.update(rounds=args.inject_rounds, write_tokens=writes, read_tokens=reads,
                   wrong_pages=s.wrong_pages, checked_pages=s.checked_pages)
    finally:
        s.close()
    return out


def summary(res: dict) -> dict:
    b = {r["backend"]: r for r in res["backends"]}
    out = {}
    if "mp" in b and b["mp"].get("floor_busy_s"):
        # Direct figures, each measured in this run: busy / idle GB/s and ms
        # over idle per round, for mp and for the no-bytes floor beside it
        # (whose rounds ran right after mp's, same mode).
        mp = b["mp"]
        f_idle, f_busy = median(mp["floor_idle_s"]), median(mp["floor_busy_s"])
        gets = mp.get("batch_get_per_round") or 1
        out["mp_busy_over_idle"] = mp["busy_over_idle"]
        out["mp_ms_over_idle_per_round"] = (mp["busy_median_s"] - mp["idle_median_s"]) * 1e3
        out["floor_busy_over_idle"] = f_idle / f_busy
        out["floor_idle_ms"], out["floor_busy_ms"] = f_idle * 1e3, f_busy * 1e3
        out["floor_ms_over_idle_per_round"] = (f_busy - f_idle) * 1e3
        # the backend's own cost of a busy scheduler, per batch_get call
        own = [((bu - i) - (fb - fi)) * 1e3 / gets for i, bu, fi, fb in
               zip(mp["idle_s"], mp["busy_s"], mp["floor_idle_s"], mp["floor_busy_s"])]
        out["mp_own_ms_per_batch_get"] = median(own)
        out["mp_own_ms_per_batch_get_runs"] = own
        out["batch_get_per_round"] = gets
        out["loop_rate_mp_over_floor"] = mp["loop_rate_busy"] / median(mp["floor_loop_rate"])
    if "mp" in b and b["mp"].get("sleep_floor_busy_s"):
        # The sleeping floor: SGLang's hand-offs plus one ideal wait per batch
        # (as long as mp's idle batch): what any backend that waits pays.
        mp = b["mp"]
        s_idle, s_busy = median(mp["sleep_floor_idle_s"]), median(mp["sleep_floor_busy_s"])
        gets = mp.get("batch_get_per_round") or 1
        out["sleep_floor_busy_over_idle"] = s_idle / s_busy
        out["sleep_floor_idle_ms"], out["sleep_floor_busy_ms"] = s_idle * 1e3, s_busy * 1e3
        out["sleep_floor_ms_over_idle_per_round"] = (s_busy - s_idle) * 1e3
        out["sleep_floor_sleep_ms"] = median(mp["sleep_floor_sleep_s"]) * 1e3
        own = [((bu - i) - (sb - si)) * 1e3 / gets for i, bu, si, sb in
               zip(mp["idle_s"], mp["busy_s"], mp["sleep_floor_idle_s"], mp["sleep_floor_busy_s"])]
        out["mp_own_ms_per_batch_get_beyond_sleep_floor"] = median(own)
        out["mp_own_ms_per_batch_get_beyond_sleep_floor_runs"] = own
        out["loop_rate_mp_over_sleep_floor"] = mp["loop_rate_busy"] / median(
            mp["sleep_floor_loop_rate"])
    if "mp" in b and "busy_switch_median_s" in b["mp"]:
        mp = b["mp"]
        out["mp_switch_over_idle"] = mp["idle_median_s"] / mp["busy_switch_median_s"]
        out["loop_rate_switch_over_plain"] = mp["loop_rate_switch"] / mp["loop_rate_busy"]
    for name, r in b.items():
        out[f"{name}_busy_over_idle"] = r["busy_over_idle"]
        if "read_with_write_s" in r:
            out[f"{name}_read_with_write_over_idle"] = r["idle_median_s"] / r["read_with_write_s"]
            out[f"{name}_read_with_write_over_paired_alone"] = r["read_with_write_over_paired"]
    out["wrong_pages"] = sum(r.get("wrong_pages", 0) for r in b.values()) + \
        res.get("injector", {}).get("wrong_pages", 0)
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="nobytes,mp,file")
    ap.add_argument("--round-mib", type=float, default=64, help="bytes per prefetch round")
    ap.add_argument("--file-round-mib", type=float, default=None,
                    help="bytes per round for SGLang's file backend (default: --round-mib; "
                         "it runs at a fraction of a GB/s under a busy scheduler)")
    ap.add_argument("--page-mib", type=float, default=1.0, help="page bytes (sets page_size)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="layer_first")
    ap.add_argument("--workers", type=int, default=0, help="hicache_mp num_workers (0 = auto)")
    ap.add_argument("--requests", type=int, default=2,
                    help="requests per round, submitted together (the round's pages split "
                         "evenly: 2 GiB rounds of 8 MiB pages are 2 requests of 128 pages)")
    ap.add_argument("--runs", type=int, default=3,
                    help="rounds per mode (and read-while-a-backup rounds); medians reported")
    ap.add_argument("--mp-key", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra-config key for hicache_mp (repeatable), e.g. io_depth=2 or "
                         "write_share=0.05")
    ap.add_argument("--switch-interval-ms", type=float, default=0.0,
                    help="also run busy rounds with sys.setswitchinterval at this value")
    ap.add_argument("--sleep-floor", action="store_true",
                    help="also run the sleeping floor beside mp's rounds: no bytes, one sleep "
                         "per batch_get_v1 as long as mp's idle batch (SGLang's hand-offs plus "
                         "one ideal wait)")
    ap.add_argument("--no-mixed", dest="mixed", action="store_false",
                    help="skip the read-while-a-backup-is-in-flight round")
    ap.add_argument("--inject-rounds", type=int, default=3, help="0: skip the failure injector")
    ap.add_argument("--inject-failure", type=float, default=0.3)
    ap.add_argument("--inject-delay", type=float, default=0.005)
    ap.add_argument("--timeout-s", type=float, default=120)
    ap.add_argument("--store", default=None, help="directory for the stores (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-trace", dest="trace", action="store_false",
                    help="skip the GIL tracer (hicache_mp/bench/giltrace.py: C calls over 1 ms and gaps "
                         "over 2 ms on SGLang's threads, per round and per backend call)")
    ap.add_argument("--trace-runs", type=int, default=3,
                    help="traced rounds per mode after the timed ones (mp and the floor)")
    args = ap.parse_args(argv)
    if any("=" not in kv for kv in args.mp_key):
        ap.error("--mp-key takes KEY=VALUE")
    args.mp_key = dict(kv.split("=", 1) for kv in args.mp_key)
    page_bytes = int(args.page_mib * 2**20)
    per_token = 2 * args.layers * args.heads * args.head_dim * 2  # bf16, K and V
    if page_bytes % per_token or args.round_mib <= 0:
        ap.error(f"--page-mib must be a multiple of {per_token} bytes (one token of this model)")
    args.page_size = page_bytes // per_token
    args.round_pages = max(1, int(args.round_mib * 2**20) // page_bytes)
    args.file_round_pages = max(1, int((args.file_round_mib or args.round_mib) * 2**20) // page_bytes)
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    global TRACE
    if args.trace:  # before SGLang's threads start: threading.setprofile reaches new threads only
        TRACE = GilTracer().install()
        TRACE.disarm()
    import torch
    sgl = R.import_stack()
    res = {"device": "cuda" if torch.cuda.is_available() else "cpu", "args": vars(args),
           "loop_rate_alone": loop_rate_alone(), "backends": [],
           "torchvision_placeholder": R.TORCHVISION_PLACEHOLDER}
    backends = [b.strip() for b in args.backends.split(",")]
    with tempfile.TemporaryDirectory(dir=args.store, prefix="hicache_mp-stack-") as root:
        floor = sleeper = None
        if "nobytes" in backends and "mp" in backends:
            os.makedirs(os.path.join(root, "floor"), exist_ok=True)
            floor = Stack(sgl, "nobytes", args, os.path.join(root, "floor"))
        if args.sleep_floor and "mp" in backends:
            os.makedirs(os.path.join(root, "sleeping"), exist_ok=True)
            sleeper = Stack(sgl, "sleeping", args, os.path.join(root, "sleeping"))
        try:
            for backend in backends:
                r = run_backend(sgl, backend, args, root, floor if backend == "mp" else None,
                                sleeper if backend == "mp" else None)
                res["backends"].append(r)
                print(json.dumps({k: v for k, v in r.items() if not k.endswith("_s")}), flush=True)
        finally:
            for st in (floor, sleeper):
                if st is not None:
                    st.close()
        if args.inject_rounds:
            res["injector"] = injector_run(sgl, args, root)
            print(json.dumps({"injector": res["injector"]}), flush=True)
    if args.trace:
        TRACE.uninstall()
        res["gil_trace"] = TRACE.report()
        print("| round | backend call | calls | C calls > 1 ms per call | gaps > 2 ms per call "
              "| ms per call | top site |", flush=True)
        for label in res["gil_trace"]:
            for row in trace_table(res["gil_trace"], label):
                print(row, flush=True)
    res["summary"] = summary(res)
    print(json.dumps({"summary": res["summary"]}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
