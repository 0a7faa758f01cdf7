"""Hand-offs on SGLang's storage threads, named and counted per prefetch.

A hand-off is a wait a storage thread makes in a call that lets the GIL go:
a `Queue.get` or `Event.wait` woken by another thread (the lock acquire that
blocks under them), a `time.sleep`, or a backend call's own wait. Under a
scheduler loop that holds the GIL, each costs its thread up to a switch
interval to get the GIL back, so their count per batch is the storage path's
structural cost (decision 86, issue 35).

`HandoffTracer` watches every thread started after `install()` (not the one
that installs it: the scheduler's part) with `threading.setprofile`, and
records each blocking C call by thread (SGLang's threads are named after
their target, e.g. `prefetch_io_aux_func`), what it waited in (Queue.get,
Event.wait, sleep, or the lock itself) and SGLang's call site, and whether
it fell inside a backend call (`batch_get_v1`, ...: the backend's own wait).
A lock acquire counts once it blocked for more than `block_us`; one that ran
out a 1 s poll timeout is an idle poll, not a hand-off, and is left out.
`Tensor.item` calls are counted too (they are on SGLang's ack path), with
whether this torch build lets the GIL go in them (`item_releases_gil`).

`dense_prefetch` and `hybrid_prefetch` drive one prefetch each through
SGLang's real controller (bench/sglang/stack.py's Stack, hybrid_rank's Rank)
under the tracer. Owns no engine logic and changes nothing it watches.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time

import torch

from hicache_mp.bench.giltrace import BACKEND_CALLS, released_in
from hicache_mp.bench.sglang import hybrid_rank, real_hybrid
from hicache_mp.bench.sglang import real as R
from hicache_mp.bench.sglang import stack as S

_PLUMBING = ("threading.py", "queue.py")
# SGLang's storage threads, by target; the backend's own threads (an engine's
# supervisor, say) wait too, but not on SGLang's path
SGLANG_THREADS = ("prefetch_thread_func", "prefetch_io_aux_func", "prefetch_sync_thread_func",
                  "backup_thread_func", "pp_prefetch_command_thread_func")
_CONTROLLERS = ("cache_controller.py", "hybrid_cache_controller.py")


def role_name(name: str) -> str:
    """SGLang's threads are unnamed: Python names them 'Thread-N (target)'."""
    return name[name.index("(") + 1:-1] if name.endswith(")") and "(" in name else name


def thread_role(thread: threading.Thread) -> str:
    return role_name(thread.name)


def _where(frame) -> tuple[str, str]:
    """(what the thread waited in, SGLang's site) for a C call made in `frame`."""
    what, f = "", frame
    while f is not None and os.path.basename(f.f_code.co_filename) in _PLUMBING:
        what = f"{'Queue' if f.f_code.co_filename.endswith('queue.py') else 'threading'}." \
               f"{f.f_code.co_name}" if not what or what.startswith("threading") else what
        f = f.f_back
    if f is None:
        return what, "?"
    return what, f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"


class HandoffTracer:
    WATCH = ("acquire", "sleep", "item")

    def __init__(self, block_us: float = 100.0):
        self.block_s = block_us / 1e6
        self.skip = {threading.get_ident()}
        self.label = None
        self.records = collections.Counter()   # (label, thread, kind, what, site, ctx) -> n
        self.rounds = collections.Counter()
        self._open: dict[int, list] = {}
        self._ctx: dict[int, list] = {}

    def install(self) -> "HandoffTracer":
        threading.setprofile(self._profile)
        return self

    def uninstall(self) -> None:
        threading.setprofile(None)

    def round(self, label: str):
        tracer = self

        class _Round:
            def __enter__(self):
                tracer.rounds[label] += 1
                tracer.label = label

            def __exit__(self, *exc):
                time.sleep(0.05)   # the last ack's wait has ended: let its thread report
                tracer.label = None
        return _Round()

    def _profile(self, frame, event, arg):
        ident = threading.get_ident()
        if ident in self.skip:
            sys.setprofile(None)
            return
        if event == "call":
            if frame.f_code.co_name in BACKEND_CALLS and \
                    os.path.basename(frame.f_code.co_filename) not in _CONTROLLERS:
                self._ctx.setdefault(ident, []).append(frame)
            return
        if event == "return":
            ctx = self._ctx.get(ident)
            if ctx and ctx[-1] is frame:
                ctx.pop()
            return
        if event == "c_call":
            if getattr(arg, "__name__", "") in self.WATCH:
                self._open.setdefault(ident, []).append((time.perf_counter(), arg, frame))
            return
        if event in ("c_return", "c_exception"):
            stack = self._open.get(ident)
            if not stack or stack[-1][1] is not arg:
                return
            t0, fn, cframe = stack.pop()
            took = time.perf_counter() - t0
            name = fn.__name__
            if self.label is None or (name == "acquire" and not self.block_s < took < 0.99):
                return
            what, site = _where(cframe)
            ctx = self._ctx.get(ident)
            backend = ctx[-1].f_code.co_name if ctx else "-"
            kind = {"acquire": "wait", "sleep": "sleep", "item": "Tensor.item"}[name]
            self.records[(self.label, thread_role(threading.current_thread()), kind,
                          what or name, site, backend)] += 1

    def table(self, label: str) -> list[dict]:
        n = max(1, self.rounds[label])
        return [{"thread": th, "kind": kind, "in": what, "site": site, "backend_call": ctx,
                 "per_prefetch": c / n}
                for (lb, th, kind, what, site, ctx), c in sorted(self.records.items())
                if lb == label]


    def sglang_waits(self, label: str) -> float:
        """SGLang's own waits per prefetch under `label`: on its storage
        threads, outside the backend's calls."""
        return sum(r["per_prefetch"] for r in self.table(label)
                   if r["thread"] in SGLANG_THREADS and r["backend_call"] == "-"
                   and r["kind"] in ("wait", "sleep"))


def item_releases_gil() -> bool:
    """Whether Tensor.item on a CPU tensor lets the GIL go in this torch build."""
    t = torch.tensor(1, dtype=torch.int)
    return any(bool(released_in(t.item, switch_s=0.2)[1]) for _ in range(3))


# --- one prefetch through SGLang's real controller, traced -------------------------------
def dense_prefetch(tracer: HandoffTracer, label: str, backend: str, store: str, *,
                   pages: int = 256, rounds: int = 3) -> dict:
    """`rounds` prefetches of one request of `pages` pages (2 of SGLang's
    128-page batches by default), after a backup and a warm-up round."""
    sgl = R.import_stack()
    args = S.parse(["--round-mib", str(pages / 128), "--page-mib", "0.0078125", "--layers", "2",
                    "--heads", "4", "--head-dim", "64", "--requests", "1", "--workers", "1",
                    "--timeout-s", "30"])
    s = S.Stack(sgl, backend, args, store)
    try:
        S.backup(s.ctl, s.src, s.tokens, s.hashes, S.Scheduler(False), 30)
        s.read(S.Scheduler(False))
        for _ in range(rounds):
            with tracer.round(label):
                s.read(S.Scheduler(False))
        return {"batches": -(-s.pages // 128), "wrong_pages": s.wrong_pages}
    finally:
        s.close()


def hybrid_prefetch(tracer: HandoffTracer, label: str, geom: str, store: str, *,
                    rounds: int = 3) -> dict:
    """`rounds` prefetches of one request of 4 KV pages and its sidecar (one
    KV batch and one batch_get_v2) through SGLang's HybridCacheController on mp."""
    r = hybrid_rank.Rank(real_hybrid.load(), real_hybrid.geometry(geom, tiny=True), "mp", store,
                         requests=1, max_pages=4, workers=1)
    try:
        r.backup(4, S.Scheduler(False), 30)
        r.finish(4, r.prefetch(4, S.Scheduler(False), 30)[1], "warm")
        for _ in range(rounds):
            with tracer.round(label):
                _, out = r.prefetch(4, S.Scheduler(False), 30)
            r.finish(4, out, label)
        return {"batches": 1, "wrong_pages": r.wrong}
    finally:
        r.close()
