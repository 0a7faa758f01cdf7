"""The opt-in GIL hand-back: a shorter switch interval while a batch waits.

Owns one thing: lowering `sys.setswitchinterval` for as long as at least one
of the adapter's batches is blocked waiting for its pages, and restoring the
value it found when the last one is back. Must not wait, poll or touch an
engine itself.

Why: a storage thread that blocked on the engine's completion semaphore
wants the GIL back the moment its pages are in; a pure-Python scheduler loop
holds the GIL and gives it up only when the waiter has asked for a whole
switch interval (5 ms by default): per batch, that wait is most of what the
backend loses under a busy scheduler. CPython reads the interval when a
thread starts waiting for the GIL, so lowering it before the thread blocks
makes its hand-back that short, while the loop runs at the default interval
whenever no batch is waiting. A process-wide lever, hence opt-in
(`gil_handback_us` in the extra config; docs/decisions.md says what it costs).
"""
from __future__ import annotations

import sys
import threading


class HandbackScope:
    """`with scope:` around a blocking wait; nested and concurrent uses share one
    lowered interval (the first in saves the old value, the last out restores it)."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds
        self._waiting = 0
        self._saved = None
        self._lock = threading.Lock()

    def __enter__(self):
        if self.seconds > 0:
            with self._lock:
                if self._waiting == 0:
                    self._saved = sys.getswitchinterval()
                    sys.setswitchinterval(min(self.seconds, self._saved))
                self._waiting += 1
        return self

    def __exit__(self, *exc):
        if self._saved is not None or self._waiting:
            with self._lock:
                if self._waiting:
                    self._waiting -= 1
                    if self._waiting == 0:
                        sys.setswitchinterval(self._saved)
                        self._saved = None
        return False
