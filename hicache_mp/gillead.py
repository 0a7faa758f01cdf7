"""Waking early enough to have the GIL back when a batch lands.

Owns one engine's estimate of how long its waiting thread takes to run
again after a worker's post (the GIL delay) and of how fast its workers
complete pages, and from those the lead: how many pages before the end of
an op the waiter asks to be woken, and how long it may then poll with the
GIL held. Must not sleep, poll or touch rings: the engine's
`_sleep_for_completion` asks it and reports to it.

Why: a thread that wakes from a semaphore must take the GIL back, and a
scheduler loop of pure Python never gives it up by itself: the waker waits
out the switch interval (5 ms). Through SGLang's controller that is one
interval per `batch_get_v1` after its last page has landed, about a tenth
of a 2 GiB round on the H200 box. Woken that much earlier, the wait for the
GIL overlaps the batch's last pages; the waiter then polls the few pages
left with the GIL held, which the scheduler would have lost to it anyway,
and gives up (sleeps again) well before the interval is over, so it is
never the thread that gets a forced switch. With no contention (the delay
is a wake-up's latency, well under LEAD_MIN_S) there is no lead at all:
waits are what they were.
"""
import math
import os
import sys

# "0" turns the lead off (waits are woken at their op's end, as before): for
# measuring what it gives (scripts/sglang_stack.py) and as an escape hatch.
LEAD_ENV = "HICACHE_MP_GIL_LEAD"

LEAD_MIN_S = 0.0005   # a delay below this is no GIL contention: no lead
EWMA_WEIGHT = 0.25    # of the newest measurement
RATE_MIN_PAGES = 4    # a sleep over fewer pages says little about the rate
SPIN_SHARE = 0.5      # of the switch interval: the longest poll with the GIL held


class GilLead:
    def __init__(self):
        self.enabled = os.environ.get(LEAD_ENV, "1") != "0"
        self.delay_s = 0.0      # EWMA: worker's post -> the waiter runs again
        self.pages_per_s = 0.0  # EWMA: the workers' completions during a sleep
        self.early = 0          # early wakes that found the op done within the spin
        self.spun_out = 0       # early wakes that slept again

    def lead_pages(self, remaining: int) -> int:
        """Pages before the end of an op to be woken at (0: at its end)."""
        if not self.enabled or self.delay_s < LEAD_MIN_S or not self.pages_per_s or \
                remaining < 2:
            return 0
        lead = math.ceil(min(self.delay_s, self.spin_s()) * self.pages_per_s)
        return max(0, min(lead, remaining - 1))

    @staticmethod
    def spin_s() -> float:
        return SPIN_SHARE * sys.getswitchinterval()

    def woke(self, posted_ns: int, woke_ns: int, pages: int, slept_ns: int) -> None:
        """A targeted sleep ended by a post: the post's and the waiter's own
        clock (monotonic ns), and the pages completed from its start to the
        post over that time."""
        if 0 < posted_ns <= woke_ns:
            self.delay_s += EWMA_WEIGHT * ((woke_ns - posted_ns) / 1e9 - self.delay_s)
        if pages >= RATE_MIN_PAGES and slept_ns > 0:
            rate = pages / (slept_ns / 1e9)
            self.pages_per_s = rate if not self.pages_per_s else \
                self.pages_per_s + EWMA_WEIGHT * (rate - self.pages_per_s)
