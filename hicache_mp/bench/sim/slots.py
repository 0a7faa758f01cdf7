"""HostSlots: the reference scheduler's free list of host-pool slots.

Owns which slot indices are free. The engine reserves a slot from submit
until its op is `done`; this list is the scheduler's own view (SGLang keeps
one too) and gets a slot back only when the op is done *and* its pages were
consumed. Must not touch page bytes or the engine.
"""
from __future__ import annotations


class HostSlots:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        # Low indices first, so small runs touch a compact part of the pool.
        self._free = list(range(num_pages - 1, -1, -1))
        self.low_water = num_pages

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None (nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        self.low_water = min(self.low_water, len(self._free))
        return taken

    def release(self, slots) -> None:
        self._free.extend(reversed(list(slots)))
