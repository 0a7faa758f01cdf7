"""A HiCache storage backend that moves no bytes and answers at once.

Behind SGLang's real controller it measures SGLang's own hand-off floor: the
time its prefetch/backup threads and queues take for a round when the backend
costs nothing. Every key exists, every get and set succeeds. Must never be
used where bytes matter.

The v2 calls (hybrid models: Mamba, SWA, DSA indexer) answer the same way:
every page of every pool present and moved, in pure Python on lists the
caller gave (no torch or numpy call, so no GIL hand-off of its own).

`Sleeping` moves no bytes either, but each batch_get_v1 lets the GIL go
once, in one sleep of `sleep_s` (the harness sets it to what a real
backend's batch took idle): the floor of any backend that must wait once
per batch for its I/O, SGLang's hand-offs and that one wait, nothing else.
"""
import time

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolName, PoolTransferResult
except ImportError as exc:  # the floor is an SGLang backend: nothing to stand without it
    raise ImportError(f"hicache_mp.bench.sglang.nobytes needs SGLang: {exc}") from exc


def _pages(transfer) -> int:
    if transfer.keys is not None:
        return len(transfer.keys)
    idx = transfer.host_indices
    return 0 if idx is None else len(idx)


class NoBytes(HiCacheStorage):
    def __init__(self, storage_config=None, kwargs=None):
        self.storage_config = storage_config

    def batch_exists(self, keys, extra_info=None) -> int:
        return len(keys)

    def hit_query_at_once(self, keys, pool_transfers=None) -> bool:
        return True   # it answers from nothing: the fast path may ask it on the scheduler thread

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        return [True] * len(keys)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        return [True] * len(keys)

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        n = len(keys)
        hits = {PoolName.KV: n}
        for t in pool_transfers or ():
            hits[t.name] = n
        return PoolTransferResult(kv_hit_pages=n, extra_pool_hit_pages=hits)

    def batch_get_v2(self, transfers, extra_info=None):
        return {t.name: [True] * _pages(t) for t in transfers}

    def batch_set_v2(self, transfers, extra_info=None):
        return {t.name: [True] * _pages(t) for t in transfers}

    def get(self, key, target_location=None, target_sizes=None):
        return target_location

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return list(target_locations or [None] * len(keys))

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return True

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return True

    def exists(self, key) -> bool:
        return True


class Sleeping(NoBytes):
    sleep_s = 0.0

    def sleep_like(self, round_s: float, floor_round_s: float, gets: int) -> float:
        """Sleep per batch as a real backend's idle round of `round_s` and
        `gets` batches, less the no-bytes floor's idle round (SGLang's own
        hand-offs), but never under half of it (on a tiny round the two are
        alike); the new sleep_s."""
        self.sleep_s = max(round_s / 2, round_s - floor_round_s) / max(gets, 1)
        return self.sleep_s

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        time.sleep(self.sleep_s)
        return [True] * len(keys)

    def batch_get_v2(self, transfers, extra_info=None):
        if any(_pages(t) for t in transfers):   # SGLang also calls it with nothing to move
            time.sleep(self.sleep_s)
        return {t.name: [True] * _pages(t) for t in transfers}
