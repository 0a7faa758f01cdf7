"""An adapter's counters and per-call figures (pages, GB/s), kept under one lock.

Counters are plain integers any thread may add to (`count`). Per-call figures
(a framework's storage metrics: pages and bandwidth of each call since it last
asked) are kept only while `per_call` is on, since a framework that never asks
would otherwise never empty them. Must not know which framework reads them.
"""
import threading


class CallStats:
    def __init__(self, counters, kinds=("prefetch", "backup"), *, per_call: bool = False):
        """`counters`: the counter names (each starts at 0). `kinds`: the kinds of
        call whose per-call pages and GB/s are kept, as `<kind>_pgs` and
        `<kind>_bandwidth` lists."""
        self._lock = threading.Lock()
        self.per_call = per_call
        self._counts = {name: 0 for name in counters}
        self._calls = {f"{k}{s}": [] for k in kinds for s in ("_pgs", "_bandwidth")}

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def record(self, kind: str, pages: int, seconds: float, page_bytes: int,
               counter: str | None = None) -> None:
        """One call of `kind` that moved `pages` pages in `seconds`; `counter`
        (if given) is counted once whatever `per_call` says."""
        with self._lock:
            if counter is not None:
                self._counts[counter] = self._counts.get(counter, 0) + 1
            if not self.per_call:
                return
            self._calls[f"{kind}_pgs"].append(pages)
            gb = pages * page_bytes / 1e9
            self._calls[f"{kind}_bandwidth"].append(gb / seconds if seconds > 0 else 0.0)

    def counters(self) -> dict:
        with self._lock:
            return dict(self._counts)

    def take_calls(self) -> dict:
        """The per-call figures since the last call, emptied."""
        with self._lock:
            out = {k: list(v) for k, v in self._calls.items()}
            for v in self._calls.values():
                v.clear()
            return out
