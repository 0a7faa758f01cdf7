"""EngineConfig: every knob of an engine, each declared once.

Owns the settings registry: every EngineConfig field carries, in its one
declaration, its type (the annotation), default, bounds, help text, command-line
flag and whether SGLang's extra config may set it. `add_engine_flags` /
`engine_options` (the CLI) and `sglang_keys` / `sglang_options` (the SGLang
adapter) are derived from those declarations, so a new setting is one field.
Values are parsed strictly in one place (`parse_value`): booleans only from
true/false/1/0/yes/no/on/off, sizes from "500G"-style strings. Must not start
anything.
"""
import argparse
import math
import os
from dataclasses import MISSING, dataclass, field, fields

from workers.control import MAX_WORKERS
from workers.store import normalize_dirs

from .cpubudget import read_budget
from .nodebudget import scheduler_cores

MAX_IO_DEPTH = 32  # lanes per worker: a bound against typos; depth 4 already never beat 2 (decision 19)

POLICIES = ("best_effort", "wait_complete", "timeout")
FSYNC_MODES = ("none", "data", "always")
DIRECT_IO_MODES = ("auto", "on", "off")
BACKENDS = ("mp", "file")
MAX_RING_CAPACITY = 1 << 20  # records (64 MiB per ring): beyond this a size is a mistake

TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
FALSE_WORDS = frozenset({"false", "0", "no", "off"})


def auto_workers() -> int:
    """What one engine alone here would start: the CPUs this process may keep
    busy (hicache_mp.engine.cpubudget: cores, affinity, cgroup quota) less what it keeps
    for its scheduler's process (hicache_mp.engine.nodebudget.scheduler_cores), at
    least one."""
    cpus = read_budget().cpus
    return max(1, cpus - scheduler_cores(cpus))


@dataclass(frozen=True)
class Setting:
    """What a field's declaration says beyond its type and default."""
    help: str
    flag: str | None = None        # command-line flag (add_engine_flags), or none
    sglang: bool = False           # settable from SGLang's extra config under the field's name
    size: bool = False             # an int of bytes that may be given as "500G"
    choices: tuple | None = None
    lo: float | None = None        # lowest allowed value (inclusive unless lo_open)
    lo_open: bool = False
    hi: float | None = None        # highest allowed value (inclusive unless hi_open)
    hi_open: bool = False
    finite: bool = True            # float('inf') refused
    metavar: str | None = None


def setting(default=MISSING, help: str = "", **kw):
    """A dataclass field declared as a setting (see Setting for `kw`)."""
    return field(default=default, metadata={"setting": Setting(help=help, **kw)})


# --- help texts long enough to be kept apart from their fields ----------------------
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
WRITE_SHARE_HELP = ("while reads wait (prefetches queued or in flight at any worker), backups "
                    "take at most this share of each worker's I/O time, measured in time, not "
                    "pages (a write can cost as much as twenty reads); with no read waiting, "
                    "backups go at full speed. Between 0 and 1, exclusive")
IO_DEPTH_HELP = ("page I/Os each worker keeps in flight (threads inside the worker process; "
                 "preadv/pwritev release the GIL); reads stay first and at most one write per "
                 "worker runs beside them (at depth 1 too, on a thread of its own). 0 = auto: 2 with "
                 "O_DIRECT, where the device's queue is the limit, 1 with buffered "
                 "I/O, where each I/O is a page-cache copy on a core and more threads than cores "
                 "only contend. Total depth is workers x this")
BACKUP_BUDGET_HELP = ("host pages that backups may hold at once (0 = the whole host pool; a "
                      "serving engine should keep room for prefetches, e.g. half the pool); "
                      "pages of a backup beyond it are dropped at once with status 'dropped', "
                      "never queued, so backup() never stalls")
STALL_HELP = ("seconds a single page I/O may run before its worker is judged stuck (a hung "
              "network filesystem, a dead disk): its pages fail at once, their host slots stay "
              "reserved until the worker is killed and gone, and a replacement starts. Keep it "
              "well above the slowest healthy page I/O")


@dataclass
class EngineConfig:
    storage_dir: str = setting(help="page store directory, or a comma-separated list of them "
                               "(one per drive): pages spread over them by digest", sglang=True)
    num_workers: int = setting(
        0, "I/O worker processes; 0 = auto: the CPUs this process may use (the host's "
        "physical cores, or HICACHE_MP_NODE_CORES, capped by its CPU affinity and its cgroup's "
        "CPU quota) less one per engine for its scheduler's process (two above 8 CPUs: the "
        "loop and the storage threads beside it), split over the engines sharing them (see "
        "node_engines), never more than the running engines left free, at least one. A count "
        "above that budget is logged: in a container it gets the whole cgroup throttled, "
        "the scheduler with it",
        flag="--hicache-mp-workers", sglang=True, lo=0, hi=MAX_WORKERS, metavar="N")
    node_engines: int = setting(
        0, "engines expected on this node that share the auto worker budget (see num_workers); 0 = those registered when this one starts, plus this one "
        "(SGLang's adapter passes the server's ranks on the node, vLLM's tier its data-parallel "
        "replicas). Only used when num_workers "
        "is 0", sglang=True, lo=0,
        hi=MAX_WORKERS, metavar="N")
    host_pool_pages: int = setting(1024, "host pool slots", lo=1)
    prefetch_policy: str = setting(
        "wait_complete", "when a request may stop waiting for its prefetch (SGLang's meaning): "
        "op.ready() is true at once (best_effort), when the op is done (wait_complete), or at "
        "its deadline (timeout)", flag="--hicache-storage-prefetch-policy", choices=POLICIES)
    prefetch_timeout_s: float = setting(
        10.0, "deadline per prefetch under the 'timeout' policy (inf: none)",
        flag="--prefetch-timeout-s", lo=0, finite=False)
    model_name: str = setting("default", "model name in the key namespace")
    tp_rank: int = setting(0, "tensor-parallel rank in the key namespace", lo=0)
    tp_size: int = setting(1, "tensor-parallel size in the key namespace", lo=1)
    namespace_extra: str = setting("", "more of the key namespace, e.g. SGLang's PP/CP suffixes")
    ring_capacity: int = setting(0, "records per ring; 0 = auto from pool pages per worker",
                                 lo=0, hi=MAX_RING_CAPACITY)
    worker_batch: int = setting(16, "records a worker takes per wake-up (cf. prefetch_factor)",
                                lo=1)
    pin_workers: bool = setting(False, "keep workers off the scheduler's core and its "
                                "hyperthread siblings", sglang=True)
    populate: bool = setting(True, "MAP_POPULATE the pool in workers")
    write_checksum: bool = setting(False, "store a payload crc32 on backup", sglang=True)
    verify_checksum: bool = setting(True, "check the payload crc32 on read when present",
                                    sglang=True)
    require_checksum: bool = setting(
        False, "refuse pages stored without a payload checksum (status 'unverified', a miss): "
        "a store written before checksums were on cannot serve unchecked bytes. Backups then "
        "store one", flag="--hicache-mp-require-checksum", sglang=True)
    quarantine_bad_files: bool = setting(
        False, "move corrupt/foreign/wrong-key files to <store>/quarantine", sglang=True)
    fsync: str = setting("none", FSYNC_HELP, flag="--hicache-mp-fsync", sglang=True,
                         choices=FSYNC_MODES)
    direct_io: str = setting("auto", DIRECT_IO_HELP, flag="--hicache-mp-direct-io", sglang=True,
                             choices=DIRECT_IO_MODES)
    backup_budget_pages: int = setting(0, BACKUP_BUDGET_HELP,
                                       flag="--hicache-mp-backup-budget-pages", sglang=True,
                                       lo=0, metavar="N")
    write_share: float = setting(0.1, WRITE_SHARE_HELP, flag="--hicache-mp-write-share",
                                 sglang=True, lo=0, lo_open=True, hi=1, hi_open=True,
                                 metavar="F")
    io_depth: int = setting(0, IO_DEPTH_HELP, flag="--hicache-mp-io-depth", sglang=True, lo=0,
                            hi=MAX_IO_DEPTH, metavar="N")
    storage_max_bytes: int = setting(
        0, "keep the page store under this size (suffixes K, M, G, T, powers of 1024); least "
        "recently read pages are evicted by a separate process to make room; a write at the "
        "limit waits up to 2 s for room, then is dropped. 0 = no limit", flag="--storage-max-bytes", sglang=True, size=True, lo=0,
        metavar="BYTES")
    storage_min_free_bytes: int = setting(
        0, "keep at least this much free on the store's filesystem, by the same eviction "
        "(suffixes as above). 0 = no floor", flag="--storage-min-free-bytes", sglang=True,
        size=True, lo=0, metavar="BYTES")
    eviction_interval_s: float = setting(10.0, "evictor pass at least this often (also when a "
                                         "limit nears)", sglang=True, lo=0, lo_open=True)
    rescan_interval_s: float = setting(0.0, ">0: rescan the store for other engines' pages this "
                                       "often", sglang=True, lo=0)
    worker_start_timeout_s: float = setting(60.0, "how long a worker may take to start", lo=0,
                                            lo_open=True)
    read_parts: int = setting(
        1, "read each page file in this many equal layer groups, each into a host slot of its "
        "own, so the first layers can go to the GPU while later ones are still read (SGLang's "
        "direct L3 linker, decision 101). Must divide the model's layers; such an engine only "
        "reads (backups go through an engine with 1)", lo=1, hi=4096, metavar="N")
    stall_timeout_s: float = setting(30.0, STALL_HELP, flag="--hicache-mp-stall-timeout",
                                     sglang=True, lo=0, lo_open=True, metavar="S")

    def __post_init__(self):
        if not self.storage_dir:
            raise ValueError("EngineConfig.storage_dir is required")
        # Every value is parsed and bounded here, before any segment or worker
        # exists (the host pool's size is checked against /dev/shm when it is created).
        for f in settings(type(self)):
            setattr(self, f.name, parse_value(f, getattr(self, f.name)))
        self.storage_dir = normalize_dirs(self.storage_dir)  # one directory, or a list: striped
        if self.read_parts > 1 and self.require_checksum:
            # a layer group's bytes cannot be checked against the whole payload's crc32
            raise ValueError("read_parts > 1 cannot verify payload checksums: set "
                             "require_checksum=False, or read_parts=1 to read whole pages")

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


# --- the registry's readers ---------------------------------------------------------
def settings(cls=None) -> list:
    """The dataclass fields of `cls` (default: EngineConfig, looked up at call
    time) declared with `setting()`."""
    return [f for f in fields(cls or EngineConfig) if "setting" in f.metadata]


def parse_value(f, value):
    """`value` for field `f`, parsed strictly and checked against its bounds.

    Strings are accepted for every type (flags, JSON written by hand); a bad
    value is a ValueError that names the field.
    """
    s: Setting = f.metadata["setting"]
    name, kind = f.name, field_kind(f)
    try:
        if kind is bool:
            value = parse_bool(value)
        elif kind is int:
            value = _parse_int(value, s.size)
        elif kind is float:
            value = _parse_float(value)
        elif kind is str:
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if s.choices is not None and value not in s.choices:
        raise ValueError(f"{name} must be one of {s.choices}, got {value!r}")
    if kind in (int, float):
        if kind is float and s.finite and math.isinf(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
        hi = "" if s.hi is None else f"{'<' if s.hi_open else '<='} {s.hi:g}"
        if s.lo is not None and not (value > s.lo if s.lo_open else value >= s.lo):  # NaN fails
            raise ValueError(f"{name} must be {'>' if s.lo_open else '>='} {s.lo:g}"
                             f"{f' and {hi}' if hi else ''}, got {value!r}")
        if s.hi is not None and not (value < s.hi if s.hi_open else value <= s.hi):
            raise ValueError(f"{name} must be {hi}, got {value!r}")
        if math.isnan(value):
            raise ValueError(f"{name} must be a number, got {value!r}")
    return value


def parse_bool(value) -> bool:
    """True/False from a bool, 0/1, or true/false/1/0/yes/no/on/off (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")


def _parse_int(value, size: bool) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        if size:
            return parse_size(value)
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"expected an integer{' or a size such as 500G' if size else ''}, "
                     f"got {value!r}")


def _parse_float(value) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ValueError(f"expected a number, got {value!r}")


_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in "500G", "1.5T", "64MiB" or "1048576" (K/M/G/T: powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _SUFFIX and t[-1:] else ""
    try:
        value = float(t[:-1] if unit else t) * _SUFFIX[unit]
        if not math.isfinite(value):
            raise ValueError
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 500G, 1T, 1048576)") from None
    if value < 0:
        raise ValueError(f"a size must be >= 0, got {text!r}")
    return int(value)


# --- front ends: the command line and SGLang's extra config ---------------------------
def add_engine_flags(parser, cls=None) -> None:
    """Every setting of `cls` that declares a flag, with its help and default."""
    for f in settings(cls):
        s = f.metadata["setting"]
        if s.flag is None:
            continue
        parser.add_argument(s.flag, dest=f.name, default=f.default, help=s.help,
                            choices=s.choices, metavar=s.metavar or _metavar(f),
                            type=_flag_type(f))


def engine_options(args, cls=None) -> dict:
    """EngineConfig keyword arguments from flags added by `add_engine_flags`."""
    return {f.name: getattr(args, f.name) for f in settings(cls)
            if f.metadata["setting"].flag is not None}


def sglang_keys(cls=None) -> frozenset:
    """The extra-config keys SGLang's adapter passes to the engine."""
    return frozenset(f.name for f in settings(cls) if f.metadata["setting"].sglang)


def sglang_options(mapping: dict, cls=None) -> dict:
    """EngineConfig keyword arguments for the SGLang keys present in `mapping`
    (parsed by EngineConfig itself, so a bad value names its key)."""
    keys = sglang_keys(cls)
    return {k: v for k, v in mapping.items() if k in keys}


def field_kind(f):
    """The field's type, also where annotations are strings (PEP 563 modules)."""
    return _TYPES.get(f.type, f.type) if isinstance(f.type, str) else f.type


_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def _metavar(f):
    return "{true,false}" if field_kind(f) is bool else None


def _flag_type(f):
    def parse(text):
        try:
            return parse_value(f, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = field_kind(f).__name__  # argparse names the type in its errors
    return parse
