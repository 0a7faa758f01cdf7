"""A store at its limit makes room for new pages (decision 84): a write that would
cross `storage_max_bytes` waits briefly while the evictor removes the least
recently used pages, so each round of new pages lands whole, the store never
goes over the limit, and what is evicted is the oldest content, not the new.
Real workers, a real evictor process, real page files.
"""
import os
import threading
import time

from faultkit import backup, content, fingerprint, make, page_file, prefetch, settle, \
    wrong_pages
from storagekit import ALIGNED, FILE_BYTES, store_bytes
from workers.evictor import headroom_bytes

LIMIT_FILES = 32
ROUND = 16       # new pages a round: twice the evictor's hysteresis band (8 pages)
ROUNDS = 5


class Sampler(threading.Thread):
    """The store's bytes on disk (page and temp files) every ~2 ms; the peak."""

    def __init__(self, root: str):
        super().__init__(daemon=True)
        self.root, self.peak, self.samples, self.stop = root, 0, 0, threading.Event()

    def run(self):
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, store_bytes(self.root))
            self.samples += 1


def test_each_round_of_new_pages_lands_and_the_oldest_are_evicted(store):
    limit = LIMIT_FILES * FILE_BYTES
    band = 2 * headroom_bytes(limit, 0, FILE_BYTES) // FILE_BYTES
    assert ROUND >= 2 * band, "a round must outgrow what one plain pass frees"
    # Passes only on demand (a worker near or at the limit wakes the evictor):
    # room must come from the writes asking for it, not from a timer.
    with make(store, geo=ALIGNED, pages=2 * ROUND, workers=2, storage_max_bytes=limit,
              eviction_interval_s=30.0) as e:
        rounds = [[f"r{r}-{i}" for i in range(ROUND)] for r in range(ROUNDS)]
        sampler = Sampler(store)
        sampler.start()
        try:
            landed = []
            for keys in rounds:
                op = backup(e, keys, range(ROUND))
                landed.append(op.status_counts().get("ok", 0))
                time.sleep(0.01)  # the next round's pages are stamped later (LRU order)
        finally:
            sampler.stop.set()
            sampler.join()
        assert landed == [ROUND] * ROUNDS, f"pages landed per round {landed} of {ROUND}"
        assert e.metrics()["write_status"].get("dropped", 0) == 0
        assert sampler.samples > 10
        assert sampler.peak <= limit, f"store at {sampler.peak} bytes, limit {limit}"
        assert store_bytes(store) <= limit

        # The newest round reads back byte-exact.
        newest = rounds[-1]
        got = prefetch(e, newest, range(ROUND, 2 * ROUND))
        assert got.status == "ok", got.status_counts()
        assert not wrong_pages(e, got, lambda k: {fingerprint(content(k, e.geometry.page_bytes))})

        # What went is the oldest: no page of a round survives one of an older
        # round that was evicted (at most one round is split), the first round
        # is gone entirely, and the index forgot it.
        present = [[os.path.exists(page_file(e, k)) for k in keys] for keys in rounds]
        gone_rounds = [r for r, p in enumerate(present) if not all(p)]
        kept_rounds = [r for r, p in enumerate(present) if any(p)]
        assert max(gone_rounds) <= min(kept_rounds), present
        assert not any(present[0]) and all(present[-1]), present
        assert settle(lambda: e.poll() is not None and e.exists(rounds[0]) == 0)
        assert e.metrics()["evicted_pages"] >= (ROUNDS * ROUND - LIMIT_FILES)
