"""GIL hand-offs on a server's storage threads, found and counted.

Two tools; neither changes what it watches:

- `GilTracer` (the harnesses: bench/sglang/stack.py, hybrid_check.py):
  `threading.setprofile` from before SGLang's threads start, so every
  thread but the scheduler's is watched. It records every C call that took
  over `call_ms` (1 ms) by call site, and every gap of over `gap_ms` (2 ms)
  between two Python events of a thread outside a C call (the thread lost
  the GIL at a forced switch and waited to get it back). Each record is
  tagged with the backend call it happened in (`batch_get_v1`,
  `batch_exists`, ...; `-` for SGLang's own code) and the round it fell in.
  A lock wait inside `threading.Condition.wait` that ended by its timeout
  (the wait returned False: an idle thread's poll, as SGLang's
  `Queue.get(timeout=1)`, which nothing on the batch's path woke) is
  recorded as kind "timeout", not "c_call".
  Under a scheduler loop that holds the GIL, a C call that lets the GIL go
  costs its thread up to a switch interval to win it back, so it shows here
  as a call of over 1 ms even when its own work took microseconds.

- `released_in(fn)` (tests/test_gil_hold.py, the vLLM tier bench): which C calls inside `fn`
  let the GIL go, deterministically. A second thread counts in pure Python
  while the switch interval is long; it can only run while `fn`'s thread has
  given the GIL up, so a C call during which its counter moved released it.

Owns no engine logic; imports nothing from the project, and must not.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import os
import sys
import threading
import time

_CONDITION_WAIT = threading.Condition.wait.__code__   # its False return is a timeout
BACKEND_CALLS = ("batch_get_v1", "batch_get_v2", "batch_exists", "batch_exists_v2",
                 "batch_set_v1", "batch_set_v2", "batch_get", "batch_set")


def _site(frame) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"


def _cname(arg) -> str:
    mod = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__name__
    return f"{mod}.{getattr(arg, '__qualname__', getattr(arg, '__name__', repr(arg)))}"


class _ThreadState:
    __slots__ = ("ccalls", "last", "calls", "name", "last_ccall")

    def __init__(self, name):
        self.ccalls = []      # (start, builtin, site) of C calls open now
        self.last = None      # perf_counter of the last Python event outside a C call
        self.calls = []       # backend calls open now: (name, id)
        self.name = name
        self.last_ccall = None  # (index in records, frame) of its last c_call record


class GilTracer:
    """See the module docstring. `install()` before the threads to watch start;
    `round(label)` brackets a round; `report()` sums per round kind and per
    backend call."""

    def __init__(self, call_ms: float = 1.0, gap_ms: float = 2.0, backend_files=("hicache_mp",
                                                                                 "nobytes")):
        self.call_s, self.gap_s = call_ms / 1e3, gap_ms / 1e3
        self.backend_files = tuple(backend_files)
        self.skip = {threading.get_ident()}  # the scheduler: the thread that installs
        self.records = []     # (round, call name, call id, kind, site, what, seconds)
        self.call_counts = collections.Counter()   # (round, backend call) -> calls
        self._round = None
        self.rounds: dict = {}  # label -> rounds run under it while armed
        self.armed = False
        self._states: dict[int, _ThreadState] = {}
        self._ids = 0
        self._lock = threading.Lock()

    # --- lifecycle ---------------------------------------------------------------
    def install(self) -> "GilTracer":
        """Watch every thread started from now on (armed)."""
        threading.setprofile(self._profile)
        self.armed = True
        return self

    def disarm(self) -> None:
        """Stop recording, for rounds that are timed: on Python 3.12+ the profile
        function leaves every thread (threading.setprofile_all_threads) and
        `arm()` puts it back; before 3.12 it stays, and returns at once."""
        self.armed = False
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(None)

    def arm(self) -> None:
        self.armed = True
        for st in self._states.values():
            st.ccalls.clear()
            st.last = None
        if hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(self._profile)

    @property
    def zero_cost_disarm(self) -> bool:
        return hasattr(threading, "setprofile_all_threads")

    def uninstall(self) -> None:
        threading.setprofile(None)
        self.disarm()
        self._round = None

    def round(self, label: str):
        """A round under `label`: counted (report's per-round figures) and its
        records tagged, while armed; nothing while disarmed (timed rounds)."""
        if not self.armed:
            return contextlib.nullcontext()
        self.rounds[label] = self.rounds.get(label, 0) + 1
        return self._tagged(label)

    @contextlib.contextmanager
    def _tagged(self, label: str):
        self._round = label
        try:
            yield
        finally:
            self._round = None

    # --- the profile function (runs on every watched thread) ----------------------
    def _profile(self, frame, event, arg):
        if not self.armed:
            return
        ident = threading.get_ident()
        if ident in self.skip:
            sys.setprofile(None)
            return
        now = time.perf_counter()
        st = self._states.get(ident)
        if st is None:
            st = self._states[ident] = _ThreadState(threading.current_thread().name)
        if event == "c_call":
            self._gap(st, frame, now)
            st.ccalls.append((now, arg, frame))
            return
        if event in ("c_return", "c_exception"):
            if st.ccalls:
                t0, fn, cframe = st.ccalls.pop()
                if now - t0 > self.call_s and self._round is not None:
                    st.last_ccall = (self._record(st, "c_call", _site(cframe), _cname(fn),
                                                  now - t0), cframe)
            st.last = now
            return
        if st.ccalls:  # Python called back from C: the C call is still open
            st.last = now
            return
        self._gap(st, frame, now)
        if event == "call" and frame.f_code.co_name in BACKEND_CALLS and \
                any(b in frame.f_code.co_filename for b in self.backend_files):
            self._ids += 1
            st.calls.append((frame.f_code.co_name, self._ids, frame))
            if self._round is not None:
                self.call_counts[self._round, frame.f_code.co_name] += 1
        elif event == "return":
            if st.calls and st.calls[-1][2] is frame:
                st.calls.pop()
            if st.last_ccall is not None and st.last_ccall[1] is frame:
                if arg is False and frame.f_code is _CONDITION_WAIT:
                    self._timed_out(st.last_ccall[0])
                st.last_ccall = None
        st.last = now

    def _timed_out(self, index: int) -> None:
        """The c_call record at `index` was a Condition.wait that timed out."""
        with self._lock:
            r = self.records[index]
            self.records[index] = r[:3] + ("timeout",) + r[4:]

    def _gap(self, st, frame, now):
        if st.last is not None and now - st.last > self.gap_s and self._round is not None:
            up = frame.f_back
            callers = " < ".join(_site(f) for f in (up, up and up.f_back) if f is not None)
            self._record(st, "gap", _site(frame), f"< {callers}" if callers else "",
                         now - st.last)
        st.last = now

    def _record(self, st, kind, site, what, seconds) -> int:
        call, cid = (st.calls[-1][0], st.calls[-1][1]) if st.calls else ("-", 0)
        with self._lock:
            self.records.append((self._round, call, cid, kind, site, what, seconds, st.name))
            return len(self.records) - 1

    # --- results -----------------------------------------------------------------
    def report(self, rounds: dict | None = None) -> dict:
        """Per round label (`rounds[label]` rounds were run; default: those
        `round()` counted). Per backend call:
        calls, C calls over the threshold per call and gaps per call, with the
        sites (per call too) and their ms."""
        rounds = self.rounds if rounds is None else rounds
        out = {}
        labels = sorted({r[0] for r in self.records} | {k[0] for k in self.call_counts})
        for label in labels:
            n = max(1, rounds.get(label, 1))
            recs = [r for r in self.records if r[0] == label]
            per_call = {}
            names = sorted({r[1] for r in recs} | {c for (lb, c) in self.call_counts if lb == label})
            for name in names:
                calls = self.call_counts.get((label, name), 0)
                mine = [r for r in recs if r[1] == name]
                div = calls if name != "-" and calls else n
                sites = collections.defaultdict(lambda: [0, 0.0])
                for r in mine:
                    key = f"{r[3]} {r[4]} {r[5]}".strip()
                    sites[key][0] += 1
                    sites[key][1] += r[6]
                per_call[name] = {
                    "calls": calls if name != "-" else None,
                    "per": "call" if name != "-" and calls else "round",
                    "c_calls_over_1ms": round(sum(r[3] == "c_call" for r in mine) / div, 3),
                    "gaps_over_2ms": round(sum(r[3] == "gap" for r in mine) / div, 3),
                    "ms": round(sum(r[6] for r in mine) * 1e3 / div, 3),
                    "sites": {k: {"count": round(c / div, 3), "ms": round(s * 1e3 / div, 3)}
                              for k, (c, s) in sorted(sites.items(), key=lambda kv: -kv[1][1])},
                }
            out[label] = {"rounds": n, "by_call": per_call}
        return out


class NullTracer:
    """GilTracer's stand-in where tracing is off: every call does nothing."""
    armed = False

    def round(self, label: str):
        return contextlib.nullcontext()

    def arm(self) -> None:
        pass

    disarm = uninstall = arm


def table(report: dict, label: str) -> list[str]:
    """Markdown rows: backend call, calls, C calls > 1 ms and gaps > 2 ms per call, top site."""
    rows = []
    for name, r in report.get(label, {}).get("by_call", {}).items():
        top = next(iter(r["sites"]), "")
        rows.append(f"| {label} | {name} | {r['calls'] if r['calls'] is not None else '-'} | "
                    f"{r['c_calls_over_1ms']} | {r['gaps_over_2ms']} | {r['ms']} | {top} |")
    return rows


# --- which C calls inside fn let the GIL go -----------------------------------------
def released_in(fn, *args, switch_s: float = 5.0, **kwargs):
    """(fn's result, [(site, what)] of the lines or C calls during which another
    thread ran).

    A second thread counts in pure Python while the switch interval is long
    (`switch_s`): it can only run while fn's thread gave the GIL up (or held
    it for a whole switch interval), so a line or C call during which its
    counter moved let the GIL go. fn must take well under `switch_s`; each
    release found costs about that long. A release of a
    few microseconds may be missed (the counter must wake inside it): repeat
    the call to find those. (A short switch interval would catch them, but its
    forced switches land inside the profile function itself and read as
    releases of whatever C call it brackets.)"""
    found = []
    result = _pass(fn, args, kwargs, switch_s, found, lines=True)
    return result, found


def _pass(fn, args, kwargs, switch_s, found, *, lines):
    count = [0]
    stop = threading.Event()
    gate = threading.Lock()

    def counter():
        # blocked here (GIL given up) until fn's thread opens the gate: then it
        # waits for the GIL, and runs only when fn's thread lets the GIL go or
        # has held it for a whole switch interval
        with gate:
            pass
        while not stop.is_set():
            count[0] += 1
    t = threading.Thread(target=counter, daemon=True)
    gate.acquire()
    old = sys.getswitchinterval()
    open_calls = []  # [counter at the call, frame, C function, pure (no Python inside)]

    def prof(frame, event, arg):
        if event == "c_call":
            open_calls.append([count[0], frame, arg, True])
        elif event in ("c_return", "c_exception"):
            if open_calls:
                c0, cframe, carg, pure = open_calls.pop()
                if count[0] != c0 and (lines or pure):
                    found.append((_site(cframe), _cname(carg)))
        elif open_calls:  # Python called back from inside a C call
            for c in open_calls:
                c[3] = False

    # Releases inside an operator (a[idx] = v, a | b) are no C call to the
    # profiler: the line tracer names the line during which the counter moved.
    last = [None, 0]

    def trace(frame, event, arg):
        if event in ("line", "return"):
            if last[0] is not None and count[0] != last[1] and not open_calls:
                found.append((last[0], "an operator on this line"))
            last[0], last[1] = _site(frame), count[0]
        return trace

    # No collection inside: finalizers it runs while the profile function runs
    # are untraced Python, whose forced switches would read as releases.
    gc_was = gc.isenabled()
    gc.disable()
    sys.setswitchinterval(switch_s)
    t.start()
    try:
        gate.release()  # keeps the GIL: the counter now waits for it
        c_start = count[0]
        sys.setprofile(prof)
        if lines:
            sys.settrace(trace)
        try:
            result = fn(*args, **kwargs)
        finally:
            sys.settrace(None)
            sys.setprofile(None)
        if lines and count[0] != c_start and not found:
            found.append(("?", "a release outside any C call seen"))
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
        if gc_was:
            gc.enable()
    return result
