"""Building an `mp` engine's resources: segments, host pool, evictor, worker pool.

Owns what PrefetchEngine's constructor makes before it takes any work: the
decision on direct I/O (and the one warning for a store this uid cannot
write), this engine's share of the node's cores, the room
check for everything it will put in /dev/shm (against /dev/shm's free space
and against what the memory cgroup's limit leaves), the host pool (its own, a
caller's descriptor, or a caller's parts), the control block, the completion
semaphore, the evictor (with storage limits), the store scanner's ring
(workers.scanner; the scan itself starts once the workers are ready,
hicache_mp.engine.storescan), the typed `WorkerSpec` and the `WorkerPool`; and releasing all of it (`release`). Returns them as one
`Resources` bundle. Must not take work, read rings or know about ops: it
builds and tears down, nothing in between.

Every segment and semaphore is named ``hicache_mp.<pid>.<random>.*`` (the
owner tag) and allocated in full at creation (shm.segment), so what fits now
can never be taken away by another process filling /dev/shm later. What was
made before a failure is released before the error goes on.
"""
import logging
import os
from dataclasses import dataclass, field

from shm import PageGeometry, WakeSemaphore, clean_stale, new_owner_tag
from shm.hostpool import HostPool
from shm.owner import OwnerLock
from shm.partpool import Part, PartPool
from shm.ring import ring_bytes
from shm.segment import SHM_SIZE_FIX, ShmFullError, shm_free_bytes, shm_total_bytes
from workers import directio, pagefile
from workers.control import CONTROL_BYTES, MAX_BYTES, MIN_FREE, Control
from workers.evictor import EVICT_RING_CAPACITY, EvictorProcess, headroom_bytes
from workers.pool import WorkerPool, worker_cpus
from workers.scanner import SCAN_RING_CAPACITY, ScannerProcess
from workers.spec import WorkerSpec
from workers.store import write_problem

from .checks import ENGINE_BYTES, check_memory_room
from .closing import EngineClosed
from .config import EngineConfig
from .cpubudget import CpuBudget, read_budget
from .nodebudget import NodeBudget, scheduler_cores

log = logging.getLogger("hicache_mp")


@dataclass(eq=False)
class Resources:
    """What one engine owns outside its own memory. `segments` close in
    reverse order (`release`): a mapping before the descriptor it maps."""
    tag: str
    stale_removed: list
    shared_pool: bool
    direct_io: bool
    direct_io_reason: str
    host_pool: object = None
    control: Control = None
    done_sem: WakeSemaphore = None
    evictor: EvictorProcess = None
    scanner: ScannerProcess = None
    pool: WorkerPool = None
    segments: list = field(default_factory=list)
    cpu_budget: CpuBudget = None


def shm_parts(pool_bytes: int, workers: int, ring_capacity: int, evictor: bool) -> list:
    """/dev/shm bytes an engine allocates, as (key, label, bytes) in the order
    they are made: pool, control block (with the completion semaphore, the
    store scan's ring and the evictor's), every worker's two submit rings and completion ring
    (twice as long); a page per semaphore (tmpfs rounds each file up to one)."""
    per_worker = 2 * ring_bytes(ring_capacity) + ring_bytes(2 * ring_capacity) + 4096
    extra = ring_bytes(SCAN_RING_CAPACITY) + (ring_bytes(EVICT_RING_CAPACITY) + 4096
                                              if evictor else 0)
    parts = [("pool", "host pool", pool_bytes)] if pool_bytes else []
    return parts + [("control", "control block", CONTROL_BYTES + extra + 4096),
                    ("rings", f"rings of {workers} worker{'s' if workers > 1 else ''}",
                     workers * per_worker)]


def shm_bytes(pool_bytes: int, workers: int, ring_capacity: int, evictor: bool) -> int:
    """/dev/shm bytes an engine allocates (shm_parts, added up)."""
    return sum(n for _, _, n in shm_parts(pool_bytes, workers, ring_capacity, evictor))


def _room_error(config: EngineConfig, geometry: PageGeometry, workers: int,
                ring_capacity: int, shared_pool: bool, *, after: str = "") -> ShmFullError | None:
    """The error of a /dev/shm too small for this engine (None if it fits): the
    parts, the one that does not fit, and the fixes for those that do not.
    `after`: a segment whose allocation failed although the check had passed."""
    slot = geometry.layer_part(config.read_parts)  # a layer group per slot (decision 101)
    pool = 0 if shared_pool else slot.pool_bytes(config.host_pool_pages)
    parts = shm_parts(pool, workers, ring_capacity, config.capacity_limited)
    needed, free = sum(n for _, _, n in parts), shm_free_bytes()
    if free is None or (needed <= free and not after):
        return None
    what = "this engine's shared memory" + (f" (allocating {after} failed)" if after else "")
    err = ShmFullError(needed, free, parts=parts, what=what, total=shm_total_bytes())
    fixes = [SHM_SIZE_FIX]
    if "pool" in err.short or (after and pool):
        fixes.append(f"lower host_pool_pages ({config.host_pool_pages} pages of "
                     f"{slot.page_bytes / 2**20:.2f} MiB now)")
    if ("rings" in err.short and "pool" not in err.short) or after:
        count = f"{workers} now" if config.num_workers else f"auto gave {workers}"
        fixes.append(f"fewer workers (num_workers, --hicache-mp-workers: {count}) or a lower "
                     f"ring_capacity ({ring_capacity} records per ring now)")
    return err.with_fixes(fixes)


def _check_memory(config: EngineConfig, geometry: PageGeometry, workers: int,
                  ring_capacity: int, shared_pool: bool) -> None:
    """ValueError where this engine's shared memory and processes do not fit
    in what the memory cgroup's limit leaves (checks.check_memory_room). A
    caller's pool (pool_fd, pool_parts) is the caller's memory, charged
    already or when the caller touches it: only the rest is counted."""
    pool = 0 if shared_pool else geometry.pool_bytes(config.host_pool_pages)
    evictor = config.capacity_limited
    fixes = []
    if pool:
        fixes.append(f"lower host_pool_pages ({config.host_pool_pages} pages of "
                     f"{geometry.page_bytes / 2**20:.2f} MiB now) or the page size")
    count = f"{workers} now" if config.num_workers else f"auto gave {workers}"
    fixes.append(f"fewer workers (num_workers, --hicache-mp-workers: {count})")
    parts = shm_parts(pool, workers, ring_capacity, evictor) + \
        [("start", "the engine's own start", ENGINE_BYTES)]
    check_memory_room(parts, workers + (1 if evictor else 0), fixes=fixes)


def _budget_words(budget: CpuBudget, engines: int) -> str:
    """The budget as a user reads it: its CPUs, where they come from, and
    what the schedulers keep."""
    keep = scheduler_cores(budget.cpus)
    each = f"{keep} kept for each of {engines} engines' schedulers" if engines > 1 else \
        f"{keep} kept for the scheduler"
    return f"{budget.cpus} CPU(s) ({budget.source}), {each}"


# The budget warnings given in this process, by their words. An engine made
# again with the same settings, as the one before it closed (the bench's
# warm-up engine, then its measured run's; a server that restarts its
# engine), has the same cause: the repeat goes to INFO. Another cause (another
# count, budget or set of engines beside it) has other words: a warning again.
_WARNED: set = set()


def _warn_once(text: str) -> None:
    if text in _WARNED:
        log.info("%s (as warned before in this process)", text)
    else:
        _WARNED.add(text)
        log.warning("%s", text)


def _say_share(share: NodeBudget, workers: int, budget: CpuBudget) -> None:
    """One line at start saying what the workers were sized from (info), or,
    where the engines of this budget run more workers than it holds, one
    warning that names the fix (as PyTorch's DataLoader warns of more workers
    than CPUs): in a container the extra ones get the whole cgroup throttled,
    the scheduler with it (decisions 89, 98). Once per cause in a process
    (_warn_once)."""
    words = _budget_words(budget, share.engines)
    split = share.split
    if share.explicit is not None:
        if not share.over_by():
            return
        room, others = max(0, split.room()), split.taken
        _warn_once(
            f"hicache_mp: num_workers={workers} is above this process's CPU budget: {words}"
            f"{f'; its other engines already run {others} workers' if others else ''}, which "
            f"leaves {room or 'none'} for workers. Workers beyond it slow the scheduler, and "
            f"under a CPU quota get the whole cgroup throttled, the scheduler with it: use "
            f"num_workers=0 (auto; --hicache-mp-workers 0, or \"num_workers\": 0 in SGLang's "
            f"extra config), at most {max(1, room - others)} workers"
            f"{' here' if others else ''}, or a higher CPU limit")
    elif share.floored():
        _warn_once(
            f"hicache_mp: auto sized this engine's workers from {words}: no CPU is left for "
            f"them, so it runs the minimum of one worker, above the budget (the engines of "
            f"this budget run {split.taken + workers} workers in all). Raise the CPU limit, "
            f"or run fewer engines under it")
    else:
        log.info("hicache_mp: %d I/O worker(s) (auto), from %s", workers, words)


def build(config: EngineConfig, geometry: PageGeometry, roots, *, pool_fd: int | None,
          pool_parts, aux_workers: int | None) -> Resources:
    """Everything PrefetchEngine's constructor documents, made in order; on any
    error what was made is released and the error goes on. `roots`: the
    store's directories (direct I/O is decided on their filesystem)."""
    if pool_fd is not None and pool_parts is not None:
        raise ValueError("give pool_fd or pool_parts, not both")
    if config.read_parts > 1 and pool_parts is not None:
        raise ValueError("read_parts > 1 needs a pool of its own or a pool_fd, not pool_parts")
    parts = None
    if pool_parts is not None:
        parts = [Part(*(int(x) for x in p)) for p in pool_parts]
        if sum(p.stride for p in parts) != geometry.page_bytes:
            raise ValueError(f"pool_parts: strides add up to {sum(p.stride for p in parts)} "
                             f"bytes, the geometry's page is {geometry.page_bytes}")
    stale_removed = clean_stale()
    shared_pool = pool_fd is not None or parts is not None
    direct_io, reason = directio.resolve(
        config.direct_io, roots, geometry, config.host_pool_pages, config.storage_max_bytes,
        page_runs=None if parts is None else (lambda page: [p.run(page) for p in parts]))
    if config.direct_io != "off":
        # One line per engine: a filesystem that refuses is worth a warning; an
        # unaligned geometry (small test pages) is expected, so only info.
        fs_refused = reason.startswith("buffered I/O: O_DIRECT on")
        (log.warning if fs_refused else log.info)("hicache_mp: %s", reason)
    # A store this uid cannot write: said once here, with the directory and the
    # fix, where each denied page only counts (and logs its cause once, no path).
    for root in roots:
        problem = write_problem(root)
        if problem:
            log.warning("hicache_mp: %s", problem)
    res = Resources(tag=new_owner_tag(), stale_removed=stale_removed, shared_pool=shared_pool,
                    direct_io=direct_io, direct_io_reason=reason)
    budget = res.cpu_budget = read_budget()

    def check_room(workers: int) -> None:
        """Everything this engine puts in /dev/shm, counted before any of it is
        made, against /dev/shm's free space and against the room the memory
        cgroup's limit leaves (decision 107)."""
        ring_capacity = config.resolved_ring_capacity(workers)
        short = _room_error(config, geometry, workers, ring_capacity, shared_pool)
        if short is not None:
            raise short
        _check_memory(config, geometry, workers, ring_capacity, shared_pool)

    # Auto: this engine's share of what the process may use (decisions 42, 89);
    # an explicit count is registered as it is, so later auto engines and the
    # warning count it (decision 98). Registered only once its room is checked,
    # so a refusal leaves no entry.
    share = NodeBudget(config.node_engines, aux_cap=aux_workers, budget=budget,
                       before_register=check_room, explicit=config.num_workers or None)
    workers = share.workers
    _say_share(share, workers, budget)
    ring_capacity = config.resolved_ring_capacity(workers)
    res.segments.append(share)  # released last, with the segments
    try:
        _build(res, config, geometry, pool_fd, parts, workers, ring_capacity)
    except ShmFullError as exc:  # /dev/shm filled by another process since the check
        release(os.getpid(), res.pool, res.segments)
        res.segments = []
        raise _room_error(config, geometry, workers, ring_capacity, shared_pool,
                          after=exc.what) from None
    except BaseException:
        release(os.getpid(), res.pool, res.segments)
        res.segments = []
        raise
    return res


def _build(res: Resources, config: EngineConfig, geometry: PageGeometry, pool_fd, parts,
           workers: int, ring_capacity: int) -> None:
    segments = res.segments
    # First made, last released (segments close in reverse): this engine's
    # segments are never without the lock that says it lives (decision 90).
    segments.append(OwnerLock(res.tag))
    own_fd = None
    if pool_fd is not None:
        own_fd = _OwnedFd(os.dup(pool_fd))
        segments.append(own_fd)  # closed after what maps it: segments close in reverse
        need = geometry.layer_part(config.read_parts).pool_bytes(config.host_pool_pages)
        have = os.fstat(own_fd.fd).st_size
        if have < need:
            raise ValueError(f"pool_fd holds {have} bytes; the geometry needs {need} "
                             f"for {config.host_pool_pages} pages")
    own_parts = None
    if parts is not None:
        dups = {}
        for fd in sorted({p.fd for p in parts}):
            dups[fd] = _OwnedFd(os.dup(fd))
            segments.append(dups[fd])
        own_parts = [Part(dups[p.fd].fd, p.offset, p.stride) for p in parts]
        res.host_pool = PartPool(own_parts, config.host_pool_pages, name=res.tag + ".pool",
                                 populate=config.populate, closed_error=EngineClosed)
    else:
        res.host_pool = HostPool(geometry.layer_part(config.read_parts), config.host_pool_pages,
                                 name=res.tag + ".pool",
                                 create=own_fd is None, populate=config.populate,
                                 fd=None if own_fd is None else own_fd.fd,
                                 closed_error=EngineClosed)
    segments.append(res.host_pool)
    control = res.control = Control(res.tag + ".ctl", create=True, num_workers=workers)
    segments.append(control)
    res.done_sem = WakeSemaphore(res.tag + ".done", create=True)
    segments.append(res.done_sem)
    headroom = 0
    orphan_shm = [res.host_pool.name, control.name]
    orphan_sem = [res.done_sem.name]
    if config.capacity_limited:
        file_bytes = pagefile.HEADER_SIZE + geometry.page_bytes
        headroom = headroom_bytes(config.storage_max_bytes, config.storage_min_free_bytes,
                                  file_bytes)
        if config.storage_max_bytes and config.storage_max_bytes < 2 * headroom + file_bytes:
            raise ValueError(f"storage_max_bytes={config.storage_max_bytes} holds too few "
                             f"pages of {file_bytes} bytes; give it at least "
                             f"{2 * headroom + file_bytes}")
        control.words[MAX_BYTES] = config.storage_max_bytes
        control.words[MIN_FREE] = config.storage_min_free_bytes
        res.evictor = EvictorProcess(tag=res.tag, control=control,
                                     storage_dir=config.storage_dir,
                                     interval_s=config.eviction_interval_s, headroom=headroom)
        segments.append(res.evictor)
        # Its first pass walks the whole store: held until the workers are
        # ready (WorkerIO posts it), so it does not slow their start.
        res.evictor.start(config.worker_start_timeout_s, hold_first_pass=True)
        orphan_shm.append(res.evictor.ring.name)
        orphan_sem.append(res.evictor.wake.name)
    res.scanner = ScannerProcess(tag=res.tag, control=control, storage_dir=config.storage_dir)
    segments.append(res.scanner)
    orphan_shm.append(res.scanner.ring.name)
    spec = WorkerSpec(
        storage_dir=config.storage_dir, geometry=geometry.to_dict(),
        pool_name=res.host_pool.name, pool_pages=config.host_pool_pages,
        pool_fd=None if own_fd is None else own_fd.fd,
        pool_parts=None if own_parts is None else
        tuple((p.fd, p.offset, p.stride) for p in own_parts),
        read_parts=config.read_parts,
        populate=config.populate,
        verify_checksum=config.verify_checksum, write_checksum=config.write_checksum,
        fsync=config.fsync, require_checksum=config.require_checksum,
        quarantine_bad_files=config.quarantine_bad_files,
        worker_batch=config.worker_batch, write_share=config.write_share,
        direct_io=res.direct_io, io_depth=config.resolved_io_depth(res.direct_io),
        num_workers=workers, capacity=config.capacity_limited,
        evict_sem=res.evictor.wake.name if res.evictor else None,
        evict_headroom=headroom, control=control.name, done_sem=res.done_sem.name,
        ring_capacity=ring_capacity, orphan_shm=tuple(orphan_shm),
        orphan_sem=tuple(orphan_sem))
    pin = worker_cpus() if config.pin_workers else None
    res.pool = WorkerPool(num_workers=workers, tag=res.tag, control=control, spec=spec,
                          ring_capacity=ring_capacity, pin_cpus=pin,
                          start_timeout_s=config.worker_start_timeout_s)


class _OwnedFd:
    """The engine's dup of a caller's pool descriptor; closing it is all it does."""

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def release(owner_pid: int, pool, segments) -> None:
    """Stop the pool and close every segment, last made first. Also the
    engine's finaliser (garbage collection, interpreter exit)."""
    if os.getpid() != owner_pid:  # a forked child's exit: the parent's, never ours to release
        return
    if pool is not None:
        pool.close()
    for seg in reversed(segments):
        try:
            seg.close()
        except Exception:
            pass
