"""Free slots of a staging pool: the host slots an adapter lends to one batch at a time.

One class for every adapter's staging path (SGLang's main staging engine, its
sidecar pools' engines). A blocking `take` for callers that may wait (SGLang's
storage threads), a `try_take` that never waits (a scheduler thread), `give`
to return them, and `lent` for a block that gives them back however it ends.
Must not know what the slots hold or call the engine.
"""
import threading
from contextlib import contextmanager


class Slots:
    def __init__(self, n: int, *, keep_sorted: bool = False):
        """`n` slots, 0..n-1, all free. `keep_sorted`: returned slots go back in
        order (the next batch gets the lowest free slots) instead of at the end."""
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"a staging pool needs a positive slot count, got {n!r}")
        self.cap = n
        self.free = list(range(n))
        self.keep_sorted = keep_sorted
        self.cond = threading.Condition()

    def take(self, n: int, timeout_s: float | None = None) -> list[int]:
        """Up to `n` free slots (at least one), waiting while none is free; an
        empty list if `timeout_s` passes first."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.free, timeout=timeout_s):
                return []
            return self._take(n)

    def try_take(self, n: int) -> list[int]:
        """Up to `n` free slots now; an empty list when none is free. Never waits."""
        with self.cond:
            return self._take(n)

    def give(self, slots) -> None:
        with self.cond:
            self.free.extend(slots)
            if self.keep_sorted:
                self.free.sort()
            self.cond.notify_all()

    @contextmanager
    def lent(self, n: int):
        """`take(n)` for the block; the slots go back when it ends, also by an
        exception (a worker's op on them is over by then: the block waited)."""
        slots = self.take(n)
        try:
            yield slots
        finally:
            self.give(slots)

    @property
    def available(self) -> int:
        return len(self.free)

    def _take(self, n: int) -> list[int]:
        out, self.free = self.free[:max(0, n)], self.free[max(0, n):]
        return out
