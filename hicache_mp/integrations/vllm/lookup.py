"""Lookups for a tier that vLLM asks about one key at a time, on its scheduler thread.

vLLM calls `lookup(key)` per chunk and takes HIT, MISS or RETRY ("ask again
next step"); on RETRY it keeps scanning, so every unknown key of a request is
asked in the same step. The answer comes from the engine's in-memory index
(no system call). A key the index does not know may still be in the store
(another vLLM instance wrote it): it is answered RETRY and queued, and the
step's queue goes to the engine's workers as one batch of probes at the end of
the step (`flush`, from on_schedule_end: one wake-up per worker, not one per
key). Its answer reaches the index through `poll()`; until then the key stays
RETRY, after it HIT, or MISS for PROBE_TTL_S (then it may be asked again, as
the engine's own negative cache allows). Must not block or make system calls.
"""
import time

from workers.timing import PROBE_TTL_S

# Keys remembered between steps; emptied when full (a forgotten key is asked again).
_MEMORY = 1 << 16


class Lookups:
    def __init__(self, engine):
        self.engine = engine
        # engine key -> (when its probe was queued, the flush that sends it)
        self.asked: dict[str, tuple[float, int]] = {}
        self.queued: list[str] = []         # this step's keys, asked at flush()
        self.flushes = 0

    def lookup(self, key: str) -> str:
        """'hit', 'miss' or 'retry' for one engine key."""
        eng = self.engine
        if eng.closed:
            return "miss"
        if eng.present((key,))[0]:
            return "hit"
        now = time.monotonic()
        asked = self.asked.get(key)
        if asked is None or now - asked[0] >= PROBE_TTL_S:
            if len(self.asked) >= _MEMORY:
                self.asked.clear()
            self.asked[key] = (now, self.flushes)
            self.queued.append(key)
            return "retry"
        if asked[1] == self.flushes or self._unanswered(key):  # not sent yet, or no answer
            return "retry"
        return "miss"

    def flush(self) -> None:
        """Ask the store about this step's unknown keys (one batch of probes)."""
        if not self.queued:
            return
        keys, self.queued = self.queued, []
        self.flushes += 1
        if not self.engine.closed:
            self.engine.ask(keys)

    @property
    def pending(self) -> bool:
        return bool(self.queued)

    def _unanswered(self, key: str) -> bool:
        return self.engine.awaiting_discovery((key,))  # its probe is out, no answer yet
