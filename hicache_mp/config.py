"""EngineConfig: every knob of an engine, with defaults a server can start with.

Owns defaults and their checks. Must not start anything.
"""
import os
from dataclasses import dataclass, field, asdict

from workers.control import MAX_WORKERS

MAX_IO_DEPTH = 32  # lanes per worker: a bound against typos; depth 4 already never beat 2 (decision 19)

POLICIES = ("best_effort", "wait_complete", "timeout")
FSYNC_MODES = ("none", "data", "always")
DIRECT_IO_MODES = ("auto", "on", "off")
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
    direct_io: str = "auto"              # auto | on | off: O_DIRECT page I/O (workers.directio)
    backup_budget_pages: int = 0         # host pages backups may hold at once; 0: the whole pool
    reads_per_write: int = 8             # a worker serves reads first; after this many in a row, one write
    io_depth: int = 0                    # page I/Os in flight per worker; 0: auto (resolved_io_depth)
    storage_max_bytes: int = 0           # >0: evict LRU pages to keep the store under this
    storage_min_free_bytes: int = 0      # >0: evict LRU pages to keep this much free on its filesystem
    eviction_interval_s: float = 10.0    # evictor pass at least this often (also when a limit nears)
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
        for name in ("backup_budget_pages", "storage_max_bytes", "storage_min_free_bytes"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0 (0 = {'auto' if name.startswith('backup') else 'off'}), "
                                 f"got {getattr(self, name)!r}")
        if not _is_int(self.io_depth) or not 0 <= self.io_depth <= MAX_IO_DEPTH:
            raise ValueError(f"io_depth must be an int in [0, {MAX_IO_DEPTH}] (0 = auto), "
                             f"got {self.io_depth!r}")
        if not _is_int(self.reads_per_write) or self.reads_per_write < 1:
            raise ValueError(f"reads_per_write must be a positive int, got {self.reads_per_write!r}")
        if not self.eviction_interval_s > 0:
            raise ValueError(f"eviction_interval_s must be > 0, got {self.eviction_interval_s!r}")
        if self.direct_io not in DIRECT_IO_MODES:
            raise ValueError(f"direct_io must be one of {DIRECT_IO_MODES}, got {self.direct_io!r}")
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

    def resolved_io_depth(self, direct_io: bool) -> int:
        """Lanes per worker: `io_depth`, or auto: 2 with O_DIRECT, else 1 (IO_DEPTH_HELP says why)."""
        return self.io_depth or (2 if direct_io else 1)

    def resolved_ring_capacity(self, workers: int) -> int:
        """Enough slots that a full pool striped over the workers always fits."""
        if self.ring_capacity:
            return self.ring_capacity
        want = 2 * (self.host_pool_pages // workers + 1) + 64
        return min(1 << 16, 1 << (want - 1).bit_length())

    def resolved_backup_budget(self) -> int:
        """Host pages backups may pin at once: `backup_budget_pages`, or the whole
        pool when it is 0.

        The caller chooses which host slots a backup names, so only the caller
        knows how many it can spare: a backup-only engine (a warm-up, an
        import) rightly names the whole pool, while a serving engine should
        keep room for prefetches (half the pool is a good start). The default
        keeps every caller's backups whole; servers set the budget.
        """
        return self.backup_budget_pages or self.host_pool_pages

    @property
    def capacity_limited(self) -> bool:
        return bool(self.storage_max_bytes or self.storage_min_free_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- engine flags --------------------------------------------------------------
# One place for the storage flags that map onto EngineConfig fields, shared by
# `hicache-mp bench` and scripts/bench_storage.py.
FSYNC_HELP = ("when a backed-up page is made durable. 'none': the page is renamed into place "
              "and left to the kernel's writeback; a power loss or kernel crash can lose recent "
              "pages, which are then later cache misses (never wrong bytes: every file is "
              "checked on read); writes run at the device's speed. 'data': fdatasync before the "
              "rename, so a page that is there after a crash holds its bytes; costs one device "
              "cache flush per page, which can make backups much slower. 'always': fsync, data "
              "and metadata; the slowest, rarely worth it for a cache")
DIRECT_IO_HELP = ("O_DIRECT page reads and writes: the device moves bytes straight to and from "
                  "the host pool, with no page-cache copy and no page-cache pollution. 'auto': "
                  "used when --storage-max-bytes is larger than physical memory (the store "
                  "outgrows the page cache, so reads are mostly cold), the store's filesystem "
                  "accepts it (probed at start; tmpfs before Linux 6.6, ramfs, many overlay/FUSE "
                  "mounts refuse) and the page runs are 4096-byte aligned; else buffered I/O, "
                  "said once in the log: the hot prefixes a server re-reads then come from the "
                  "page cache, far faster than any disk. 'on': O_DIRECT whatever the store's "
                  "size, and an error at start if the filesystem or geometry cannot do it. "
                  "'off': buffered I/O always")


IO_DEPTH_HELP = ("page I/Os each worker keeps in flight (threads inside the worker process; "
                 "preadv/pwritev release the GIL); reads stay first and at most one write per "
                 "worker runs beside them. 0 = auto: 2 with O_DIRECT, where the device's queue "
                 "is the limit (H200 box: write-through 1.2-1.3x at 15 workers), 1 with buffered "
                 "I/O, where each I/O is a page-cache copy on a core and more threads than cores "
                 "only contend. Total depth is workers x this")


def add_engine_flags(parser) -> None:
    """The storage flags (--hicache-mp-direct-io, --hicache-mp-fsync, capacity) on `parser`."""
    parser.add_argument("--hicache-mp-direct-io", choices=DIRECT_IO_MODES, default="auto",
                        help=DIRECT_IO_HELP)
    parser.add_argument("--hicache-mp-io-depth", type=int, default=0, metavar="N",
                        help=IO_DEPTH_HELP)
    parser.add_argument("--hicache-mp-fsync", choices=FSYNC_MODES, default="none", help=FSYNC_HELP)
    parser.add_argument("--hicache-mp-backup-budget-pages", type=int, default=0, metavar="N",
                        help="host pages that backups may hold at once (0 = the whole host pool; a serving engine should keep room for prefetches, e.g. half the pool); "
                             "pages of a backup beyond it are dropped at once with status "
                             "'dropped', never queued, so backup() never stalls")
    parser.add_argument("--storage-max-bytes", type=_size, default=0, metavar="BYTES",
                        help="keep the page store under this size (suffixes K, M, G, T, powers "
                             "of 1024); least recently read pages are evicted by a separate "
                             "process, and writes that would cross it are dropped. 0 = no limit")
    parser.add_argument("--storage-min-free-bytes", type=_size, default=0, metavar="BYTES",
                        help="keep at least this much free on the store's filesystem, by the "
                             "same eviction (suffixes as above). 0 = no floor")


def engine_options(args) -> dict:
    """EngineConfig keyword arguments from flags added by `add_engine_flags`."""
    return {"direct_io": args.hicache_mp_direct_io, "fsync": args.hicache_mp_fsync,
            "io_depth": args.hicache_mp_io_depth,
            "backup_budget_pages": args.hicache_mp_backup_budget_pages,
            "storage_max_bytes": args.storage_max_bytes,
            "storage_min_free_bytes": args.storage_min_free_bytes}


_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


# EngineConfig fields a server's own configuration may set by name (SGLang's
# extra-config, hicache_mp.integrations.sglang): the storage behaviour of
# add_engine_flags, plus the knobs behind it.
STORAGE_KEYS = ("direct_io", "io_depth", "fsync", "backup_budget_pages", "storage_max_bytes",
                "storage_min_free_bytes", "reads_per_write", "eviction_interval_s",
                "quarantine_bad_files")
_SIZE_KEYS = ("storage_max_bytes", "storage_min_free_bytes")


def storage_options_from(mapping: dict) -> dict:
    """EngineConfig keyword arguments for the STORAGE_KEYS present in `mapping`.

    Sizes may be strings with suffixes ("500G"); every value is then checked
    by EngineConfig itself, so a bad one is a ValueError naming the field
    before any worker starts.
    """
    out = {}
    for key in STORAGE_KEYS:
        if key in mapping:
            value = mapping[key]
            out[key] = parse_size(value) if key in _SIZE_KEYS and isinstance(value, str) else value
    return out


def _size(text: str) -> int:
    """argparse type for sizes: parse_size with argparse's error."""
    import argparse
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_size(text: str) -> int:
    """Bytes in "500G", "1.5T", "64MiB" or "1048576" (K/M/G/T: powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _SUFFIX and t[-1:] else ""
    try:
        value = int(float(t[:-1] if unit else t) * _SUFFIX[unit])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 500G, 1T, 1048576)") from None
    if value < 0:
        raise ValueError(f"a size must be >= 0, got {text!r}")
    return value
