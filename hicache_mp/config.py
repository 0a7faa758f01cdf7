"""EngineConfig: every knob of an engine, with defaults a server can start with.

Owns defaults and their checks. Must not start anything.
"""
import os
from dataclasses import dataclass, field, asdict

from workers.control import MAX_WORKERS

POLICIES = ("best_effort", "wait_complete", "timeout")
FSYNC_MODES = ("none", "data", "always")
BACKENDS = ("mp", "file")
MAX_RING_CAPACITY = 1 << 20  # records (64 MiB per ring): beyond this a size is a mistake


def auto_workers() -> int:
    """Physical cores minus one for the scheduler, at least one."""
    import psutil
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count() or 2
    return max(1, cores - 1)


@dataclass
class EngineConfig:
    storage_dir: str
    num_workers: int = 0                 # 0: auto (physical cores - 1)
    host_pool_pages: int = 1024
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float = 10.0     # for the "timeout" policy
    model_name: str = "default"
    tp_rank: int = 0
    tp_size: int = 1
    namespace_extra: str = ""            # e.g. SGLang's PP/CP suffixes
    ring_capacity: int = 0               # 0: auto from pool pages per worker
    worker_batch: int = 16               # records a worker takes per wake-up (cf. prefetch_factor)
    pin_workers: bool = False
    populate: bool = True                # MAP_POPULATE the pool in workers
    write_checksum: bool = False         # store a payload crc32 on backup
    verify_checksum: bool = True         # check it on read when present
    quarantine_bad_files: bool = False   # move corrupt/foreign/wrong-key files to <store>/quarantine
    fsync: str = "none"                  # none | data | always
    rescan_interval_s: float = 0.0       # >0: rescan the store for other engines' pages
    worker_start_timeout_s: float = 60.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.storage_dir:
            raise ValueError("EngineConfig.storage_dir is required")
        self.storage_dir = os.path.abspath(os.path.expanduser(self.storage_dir))
        # Absurd sizes are refused here, before any segment or worker exists
        # (the host pool's size is checked against /dev/shm when it is created).
        if not _is_int(self.num_workers) or not 0 <= self.num_workers <= MAX_WORKERS:
            raise ValueError(f"num_workers must be in [0, {MAX_WORKERS}] (0 = auto), "
                             f"got {self.num_workers!r}")
        if not _is_int(self.host_pool_pages) or self.host_pool_pages <= 0:
            raise ValueError(f"host_pool_pages must be a positive int, got {self.host_pool_pages!r}")
        if not _is_int(self.ring_capacity) or not 0 <= self.ring_capacity <= MAX_RING_CAPACITY:
            raise ValueError(f"ring_capacity must be in [0, {MAX_RING_CAPACITY}] (0 = auto), "
                             f"got {self.ring_capacity!r}")
        for name in ("prefetch_timeout_s", "rescan_interval_s"):
            if not getattr(self, name) >= 0:  # also refuses NaN
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.prefetch_policy not in POLICIES:
            raise ValueError(f"prefetch_policy must be one of {POLICIES}, got {self.prefetch_policy!r}")
        if self.fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}, got {self.fsync!r}")
        if self.worker_batch <= 0:
            raise ValueError("worker_batch must be positive")

    def resolved_workers(self) -> int:
        return self.num_workers or auto_workers()

    def resolved_ring_capacity(self, workers: int) -> int:
        """Enough slots that a full pool striped over the workers always fits."""
        if self.ring_capacity:
            return self.ring_capacity
        want = 2 * (self.host_pool_pages // workers + 1) + 64
        return min(1 << 16, 1 << (want - 1).bit_length())

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
