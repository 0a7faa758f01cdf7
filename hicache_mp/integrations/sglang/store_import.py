"""`hicache-mp import-sglang`: convert an SGLang `file` store into a hicache_mp store.

Owns the conversion: find SGLang's raw page files (`<key><suffix>.bin`, no
header, bytes in the writing server's host layout), check each against the
geometry, put it into an engine's host pool in logical order, and let the
engine's workers write it (header, canonical payload, temp file + rename).
Must not delete or change anything under the source directory, and must not
write page files itself (the workers do). Imports no SGLang: it reads SGLang's
files, not its classes.

Which files belong to which namespace follows SGLang's `HiCacheFile` suffix
(`names`), so the pages land exactly where
`HiCacheMP` (the SGLang backend) looks for them: same model name, TP ranks
(one namespace for MLA), PP suffix.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from shm import PageGeometry
from workers import naming
from workers import status as st

from ...engine import PrefetchEngine
from ...engine.config import EngineConfig
from .layouts import RAW_LAYOUTS, flat_page_view
from .names import SGLangShard

BATCH_PAGES = 64
EXAMPLES = 3


@dataclass
class ImportReport:
    imported: int = 0
    skipped: Counter = field(default_factory=Counter)      # reason -> files
    examples: dict = field(default_factory=dict)           # reason -> a few file names
    per_shard: dict = field(default_factory=dict)          # suffix -> imported

    def skip(self, reason: str, name: str) -> None:
        self.skipped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < EXAMPLES:
            ex.append(name)

    @property
    def failed(self) -> int:
        return sum(n for r, n in self.skipped.items() if r.startswith("write failed"))

    def lines(self) -> list[str]:
        out = [f"imported {self.imported} page(s)"]
        for suffix, n in self.per_shard.items():
            out.append(f"  {n:8d}  from files *{suffix}.bin")
        for reason, n in sorted(self.skipped.items()):
            out.append(f"skipped {n} file(s): {reason}  (e.g. {', '.join(self.examples[reason])})")
        return out


def shards_for(model: str, *, tp_size: int = 1, tp_rank: int | None = None, pp_size: int = 1,
               pp_rank: int | None = None, mla: bool = False,
               identity: str = "") -> list[SGLangShard]:
    """The SGLang shards to import: one rank, or all of them when a rank is None.
    `identity`: the weights' (common.identity.model_identity, decision 91), the
    one the backend computes for the server that will read the pages."""
    tps = [0] if mla else ([tp_rank] if tp_rank is not None else list(range(tp_size)))
    pps = [pp_rank] if pp_rank is not None else list(range(pp_size))
    for r, n, what in ((tp_rank, tp_size, "tp"), (pp_rank, pp_size, "pp")):
        if r is not None and not 0 <= r < n:
            raise ValueError(f"--{what}-rank {r} is out of range for --{what}-size {n}")
    return [SGLangShard(model_name=model, tp_rank=t, tp_size=tp_size, pp_rank=p, pp_size=pp_size,
                        is_mla=mla, identity=identity) for p in pps for t in tps]


def import_sglang_store(src: str, dst: str, geometry: PageGeometry, src_layout: str,
                        shards: list[SGLangShard], *, workers: int = 2, overwrite: bool = False,
                        progress=None) -> ImportReport:
    """Convert every page of `shards` found in `src` into the store at `dst`."""
    import torch

    if src_layout not in RAW_LAYOUTS:
        raise ValueError(f"layout must be one of {RAW_LAYOUTS}, got {src_layout!r}")
    if not os.path.isdir(src):
        raise ValueError(f"source directory {src!r} does not exist")
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ValueError("--src and --dst must be different directories")
    g = geometry.with_layout("page_first")
    flat_page_view(torch.empty(g.page_bytes // g.itemsize, dtype=getattr(torch, g.dtype)),
                   src_layout, g)  # refuses layouts this geometry cannot have (page_head + MLA)
    report = ImportReport()
    by_shard: dict[str, list[tuple[str, str]]] = {s.file_suffix + ".bin": [] for s in shards}
    with os.scandir(src) as it:
        entries = sorted((e for e in it), key=lambda e: e.name)
    for e in entries:
        if not e.is_file(follow_symlinks=False):
            continue
        if e.name.startswith(".") or not e.name.endswith(".bin"):
            report.skip("not an SGLang page file (*.bin)", e.name)
            continue
        match = [end for end in by_shard if e.name.endswith(end) and len(e.name) > len(end)]
        if not match:
            report.skip("another model, rank or shard (suffix does not match)", e.name)
            continue
        end = max(match, key=len)
        key = e.name[:-len(end)]
        if "." in key:
            report.skip("not a KV page (a sidecar pool such as .mamba)", e.name)
            continue
        size = e.stat(follow_symlinks=False).st_size
        if size != g.page_bytes:
            report.skip(f"size does not match the geometry ({g.page_bytes} bytes per page)", e.name)
            continue
        try:
            naming.check_key(key)
        except ValueError:
            report.skip("key refused by hicache_mp naming", e.name)
            continue
        by_shard[end].append((key, e.path))

    dtype = getattr(torch, g.dtype)
    for shard in shards:
        end = shard.file_suffix + ".bin"
        files = by_shard[end]
        report.per_shard[shard.file_suffix] = 0
        if not files:
            continue
        cfg = EngineConfig(storage_dir=dst, num_workers=workers,
                           host_pool_pages=min(BATCH_PAGES, len(files)), **shard.engine_names())
        with PrefetchEngine(cfg, g) as eng:
            if not overwrite:
                keep = []
                eng.wait_scanned()  # present() answers from the index: whole once the scan ends
                present = eng.present([key for key, _ in files])
                for (key, path), there in zip(files, present):
                    if there:
                        report.skip("already in the destination store", os.path.basename(path))
                    else:
                        keep.append((key, path))
                files = keep
            raw = np.empty(g.page_bytes, dtype=np.uint8)
            for start in range(0, len(files), cfg.host_pool_pages):
                chunk = files[start:start + cfg.host_pool_pages]
                for slot, (key, path) in enumerate(chunk):
                    with open(path, "rb", buffering=0) as f:
                        got = f.readinto(memoryview(raw))
                    if got != g.page_bytes:  # changed under us since the stat
                        raise OSError(f"short read of {path}: {got} of {g.page_bytes} bytes")
                    flat = torch.from_numpy(raw).view(dtype)
                    eng.host_pool.page_view(slot).copy_(flat_page_view(flat, src_layout, g))
                op = eng.backup([k for k, _ in chunk], list(range(len(chunk))))
                eng.wait(op)
                for pos, code in enumerate(op.page_status.tolist()):
                    if code == st.OK:
                        report.imported += 1
                        report.per_shard[shard.file_suffix] += 1
                    else:
                        report.skip(f"write failed: {st.NAMES[code]}", os.path.basename(chunk[pos][1]))
                if progress:
                    progress(report)
    return report
