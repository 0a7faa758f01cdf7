"""hicache_mp: a GIL-free, multiprocess prefetch engine for hierarchical KV caches.

Owns the scheduler-facing API (docs/design.md). Must not do page I/O itself:
worker processes (package `workers`) move the bytes.
"""
from shm import PageGeometry
from workers.pool import BrokenPool

from .engine import EngineClosed, EngineConfig, EngineForked, Op, PrefetchEngine

__all__ = ["PrefetchEngine", "EngineConfig", "PageGeometry", "Op", "make_engine",
           "BrokenPool", "EngineClosed", "EngineForked"]
__version__ = "0.1.0"


def make_engine(backend: str, config: EngineConfig, geometry: PageGeometry, **options):
    """`mp` (this engine), or an in-process threaded baseline: `file` (SGLang's
    file backend) or `fast_file` (SGLang PR #39880; options: read_workers,
    write_workers)."""
    if backend == "mp":
        return PrefetchEngine(config, geometry)
    if backend == "file":
        from .bench.baseline import ThreadedFileEngine
        return ThreadedFileEngine(config, geometry)
    if backend == "fast_file":
        from .bench.fast_file import FastFileEngine
        return FastFileEngine(config, geometry, **options)
    raise ValueError(f"unknown storage backend {backend!r}; choose 'mp', 'file' or 'fast_file'")
