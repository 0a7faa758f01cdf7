"""A HiCache storage backend that moves no bytes and answers at once.

Behind SGLang's real controller it measures SGLang's own hand-off floor: the
time its prefetch/backup threads and queues take for a round when the backend
costs nothing. Every key exists, every get and set succeeds. Must never be
used where bytes matter.
"""
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage


class NoBytes(HiCacheStorage):
    def __init__(self, storage_config=None, kwargs=None):
        self.storage_config = storage_config

    def batch_exists(self, keys, extra_info=None) -> int:
        return len(keys)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        return [True] * len(keys)

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        return [True] * len(keys)

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
