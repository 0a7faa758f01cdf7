"""WorkerSpec: everything one I/O worker is told at start, typed, in one place.

The engine builds one (`PrefetchEngine`, from its EngineConfig and what it
created), the pool binds it to a worker slot (`bind`: index, rings, parent),
and the worker reads it back (`from_json`). It travels as JSON on the
worker's argv. Field names are EngineConfig's where a setting comes from
there, and nothing here has a default a worker could silently fall back on:
a missing or unknown field is an error at the worker's start.

Must not decide values: the engine does (it resolves io_depth, direct_io...).
"""
import json
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class WorkerSpec:
    # settings (from the engine's EngineConfig, resolved)
    storage_dir: str
    geometry: dict
    pool_name: str
    pool_pages: int
    pool_fd: int | None             # an fd-mapped pool (SGLang's memfd), passed at this number
    pool_parts: tuple | None        # or a pool of several regions: (fd, offset, stride) per
                                    # part (shm.partpool), each fd passed at its number
    read_parts: int                 # >1: a slot holds one layer group of a page (decision 101);
                                    # a READ record's io_ns names the group
    populate: bool
    verify_checksum: bool
    write_checksum: bool
    require_checksum: bool
    fsync: str
    quarantine_bad_files: bool
    worker_batch: int
    write_share: float
    direct_io: bool
    io_depth: int
    num_workers: int
    capacity: bool                  # storage limits are on: reserve before each write
    evict_sem: str | None           # the evictor's wake-up, with capacity
    evict_headroom: int
    control: str
    done_sem: str
    ring_capacity: int
    orphan_shm: tuple               # names an orphaned worker unlinks (the engine's)
    orphan_sem: tuple
    # the slot, filled by bind()
    index: int = -1
    parent_pid: int = 0
    read_ring: str = ""
    write_ring: str = ""
    completion_ring: str = ""
    completion_capacity: int = 0
    wake_sem: str = ""

    def bind(self, *, index: int, parent_pid: int, read_ring: str, write_ring: str,
             completion_ring: str, completion_capacity: int, wake_sem: str) -> "WorkerSpec":
        """This spec for worker `index`, with its own rings; orphans also unlink those."""
        return replace(self, index=index, parent_pid=parent_pid, read_ring=read_ring,
                       write_ring=write_ring, completion_ring=completion_ring,
                       completion_capacity=completion_capacity, wake_sem=wake_sem,
                       orphan_shm=(*self.orphan_shm, read_ring, write_ring, completion_ring),
                       orphan_sem=(*self.orphan_sem, wake_sem))

    def pool_fds(self) -> tuple:
        """Every descriptor the worker maps its pool from (Popen pass_fds)."""
        if self.pool_parts is not None:
            return tuple(sorted({int(p[0]) for p in self.pool_parts}))
        return () if self.pool_fd is None else (self.pool_fd,)

    def to_json(self) -> str:
        if self.index < 0:
            raise ValueError("WorkerSpec is not bound to a worker slot (bind())")
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"WorkerSpec: unknown fields {sorted(unknown)}")
        raw["orphan_shm"] = tuple(raw["orphan_shm"])
        raw["orphan_sem"] = tuple(raw["orphan_sem"])
        if raw.get("pool_parts") is not None:
            raw["pool_parts"] = tuple(tuple(p) for p in raw["pool_parts"])
        spec = cls(**raw)
        if spec.index < 0:
            raise ValueError("WorkerSpec: no worker slot (index)")
        return spec
