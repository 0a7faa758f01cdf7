"""Shared-memory layer: segments, the host pool's byte layout, SPSC rings, wake-ups.

Owns everything that lives in POSIX shared memory. Must not know about files,
worker processes, engines or CUDA, and must stay importable without torch
(workers import it; only `HostPool.tensor` pulls torch in, lazily).
"""
from .names import PREFIX, clean_stale, new_owner_tag
from .segment import Segment
from .geometry import PageGeometry
from .ring import Ring, RECORD_DTYPE
from .hostpool import HostPool
from .partpool import Part, PartPool
from .wake import WakeSemaphore

__all__ = ["PREFIX", "clean_stale", "new_owner_tag", "Segment", "PageGeometry",
           "Ring", "RECORD_DTYPE", "HostPool", "Part", "PartPool", "WakeSemaphore"]
