"""`hicache-mp bench`: a warm store, then the reference scheduler once per backend on it.

Owns the bench configuration (full scale and `--quick`), host-pool sizing,
the warm-up pass, one measured run per backend (`none`, `file`, `file` with
the yield workaround, `fast_file` at one or more read-thread counts, `mp`, and
on request `mp-direct`: SGLang's direct L3 path, `direct`) on the same store,
and the report's header. Must not parse argv
(`hicache_mp.cli`), run the loop (`scheduler`), work out a run's figures
(`report`, whose names the CLI imports from here too) or format text
(`summary`).
"""
from __future__ import annotations

import os
import platform
import secrets
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine, make_engine
from workers import naming
from workers.stores import open_store

from .instant import InstantStore
from .pagecache import resident_share
from .pagebytes import PageBytes
from .report import SCHEMA, comparison, figures
from .report import busy_machine_note, merge_reports, table_rows  # noqa: F401 (API: cli, scripts)
from .scheduler import RunResult, Scheduler, SchedulerConfig
from .workload import (CHUNK_TOKENS, DECODE_S_PER_TOKEN, MAX_IN_FLIGHT, PREFILL_TOKENS_PER_S,
                       ComputeModel, describe, make_workload)

FULL_GEOMETRY = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}   # Llama-3.1-8B
QUICK_GEOMETRY = {"num_layers": 4, "num_kv_heads": 4, "head_dim": 64}    # 256 KiB per 64-token page
# --quick: prompts (so pages) x0.1, every duration x0.2. The stock `file` run
# costs a fixed ~10-80 ms of GIL hand-offs per page whatever its size, so the
# page count, not the bytes, bounds the quick run's length on 2 cores.
QUICK_PROMPT_SCALE = 0.1
QUICK_TIME_SCALE = 0.2
ALL_RUNS = ("none", "file", "file+yield", "fast_file", "mp")
DIRECT = "mp-direct"   # SGLang's direct L3 path through hicache_mp's linker (on request)
POOL_RAM_SHARE = 0.4       # most of the host pool a run may take of free shm / RAM
WARMUP_BATCH_BYTES = 2 << 30


@dataclass
class BenchConfig:
    runs: tuple = ALL_RUNS          # labels: none | file | file+yield | fast_file[/rN] | mp
    num_requests: int = 32
    seed: int = 0
    quick: bool = False
    page_size: int = 64
    layout: str = "page_first"
    dtype: str = "bfloat16"
    workers: int = 0                # 0: auto (the CPUs this process may use less one or two for the scheduler's process)
    policy: str = "wait_complete"
    timeout_s: float = 10.0
    yield_ms: float = 1.0           # the file+yield run's sleep per loop iteration
    fast_file_write_workers: int = 1  # fast_file runs' write threads (read threads: the label)
    storage_dir: str | None = None  # None: a temp dir, removed at the end
    host_pool_pages: int = 0        # 0: auto
    verify: bool = True
    device_load: str = "auto"       # auto: load prefetched pages to the GPU when CUDA is there;
                                    # on: also on the CPU fallback; off: never
    max_run_s: float = 3600.0
    layer_groups: int = 0           # mp-direct: layer groups a page is read in; 0: the
                                    # linker's rule (device.layered.auto_groups)
    engine_options: dict = field(default_factory=dict)  # more EngineConfig fields (storage flags)
    geometry: dict = field(default_factory=dict)   # overrides (tests)
    prompt_scale: float | None = None   # None: 1.0, or QUICK_PROMPT_SCALE with --quick
    time_scale: float | None = None     # None: 1.0, or QUICK_TIME_SCALE with --quick

    @property
    def scales(self) -> tuple[float, float]:
        """(prompt scale, time scale) in effect."""
        p = self.prompt_scale if self.prompt_scale is not None else (
            QUICK_PROMPT_SCALE if self.quick else 1.0)
        t = self.time_scale if self.time_scale is not None else (
            QUICK_TIME_SCALE if self.quick else 1.0)
        return p, t


def fast_file_label(read_workers: int) -> str:
    """The run label of `fast_file` with `read_workers` read threads."""
    return "fast_file" if read_workers == 1 else f"fast_file-r{read_workers}"


SLEEP0 = "+sleep0"   # label suffix: the loop does SGLang 0.5.23's on_idle time.sleep(0)


def run_spec(label: str, yield_ms: float, write_workers: int = 1) -> tuple[str, float, dict]:
    """(storage backend, yield ms, backend options) of a run label (without SLEEP0)."""
    if label == "file+yield":
        return "file", yield_ms, {}
    if label == "fast_file" or label.startswith("fast_file-r"):
        n = label[len("fast_file-r"):] if label != "fast_file" else "1"
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"bad fast_file run {label!r}: fast_file-r<read workers>")
        return "fast_file", 0.0, {"read_workers": int(n), "write_workers": write_workers}
    if label not in ("none", "file", "mp", DIRECT):
        raise ValueError(f"unknown run {label!r}; choose from {ALL_RUNS + (DIRECT,)}")
    return label, 0.0, {}


class Bench:
    def __init__(self, cfg: BenchConfig, log=None):
        self.cfg = cfg
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        s, ts = cfg.scales
        geo = {**(QUICK_GEOMETRY if cfg.quick else FULL_GEOMETRY), **cfg.geometry}
        self.geometry = PageGeometry(page_size=cfg.page_size, dtype=cfg.dtype,
                                     layout=cfg.layout, **geo)
        self.requests = make_workload(cfg.num_requests, seed=cfg.seed, scale=s,
                                      page_size=cfg.page_size)
        # Chunks shrink with the prompts; every duration (prefill of a chunk, a
        # decode step, the release interval) shrinks by `ts`.
        self.compute = ComputeModel(prefill_tokens_per_s=PREFILL_TOKENS_PER_S * s / ts,
                                    chunk_tokens=max(cfg.page_size, round(CHUNK_TOKENS * s)),
                                    decode_s_per_token=DECODE_S_PER_TOKEN * ts)
        self.arrival_scale = ts
        self.pool_pages = cfg.host_pool_pages or self._auto_pool_pages()
        self._check_pool()
        self.direct_groups = self._check_direct() if DIRECT in cfg.runs else None
        self.nonce = secrets.token_hex(4)
        self.pagebytes = PageBytes(self.geometry, seed=cfg.seed)
        self.cpu_budget = None  # the report's cpu_budget, from the warm-up's engine

    # --- sizing ---------------------------------------------------------------
    def _cached_pages(self) -> list[int]:
        return [r.cached_len // self.cfg.page_size for r in self.requests]

    def _headroom_pages(self) -> int:
        # Write-back of a few chunks in flight at once.
        return 4 * -(-self.compute.chunk_tokens // self.cfg.page_size)

    def _auto_pool_pages(self) -> int:
        """Room for the hit pages of `max_in_flight` requests at once, capped by memory."""
        biggest = sorted(self._cached_pages(), reverse=True)[:MAX_IN_FLIGHT]
        want = sum(biggest) + self._headroom_pages()
        return max(min(want, self._memory_cap_pages()), 1)

    def _memory_cap_pages(self) -> int:
        import psutil
        free = psutil.virtual_memory().total
        try:
            free = min(free, shutil.disk_usage("/dev/shm").free)
        except OSError:
            pass
        return int(free * POOL_RAM_SHARE) // self.geometry.page_bytes

    def _check_pool(self) -> None:
        need = max(self._cached_pages()) + self._headroom_pages()
        if self.pool_pages < need:
            raise ValueError(
                f"host pool of {self.pool_pages} pages cannot hold the largest request "
                f"({need} pages with write-back room); give more memory or fewer/smaller "
                f"requests (--num-requests, --host-pool-pages)")

    def store_bytes(self) -> int:
        """Disk the warm store plus one run's write-backs take (headers included)."""
        ps = self.cfg.page_size
        cached = sum(self._cached_pages())
        computed = sum(r.prompt_len // ps - r.cached_len // ps for r in self.requests)
        return (cached + computed) * (self.geometry.page_bytes + 4096)

    # --- the whole bench ------------------------------------------------------
    def run(self, on_result=None) -> dict:
        """Warm the store, run every configured backend; the JSON-ready report."""
        cfg = self.cfg
        tmp = cfg.storage_dir is None
        store = cfg.storage_dir or _tempdir()
        try:
            self._check_disk(store)
            report = self._header(store)
            report["warmup"] = self.warm_up(store)
            report["cpu_budget"] = self.cpu_budget
            for label in cfg.runs:
                load0 = os.getloadavg()[0]
                res = self.run_backend(label, store)
                figs = figures(res, self.cfg.page_size)
                figs["load_avg"] = [load0, os.getloadavg()[0]]   # 1-minute, before and after
                report["runs"][label] = figs
                if on_result:
                    on_result(label, res, figs)
            report["comparison"] = comparison(report["runs"])
            return report
        finally:
            if tmp:
                shutil.rmtree(store, ignore_errors=True)

    def _check_disk(self, store: str) -> None:
        pages = open_store(store)  # one directory, or a striped list
        pages.create()
        # A store kept from an earlier run (same --storage-dir) already holds its share.
        need = max(0, self.store_bytes() - pages.scan().total_bytes)
        # Pages spread evenly over the directories: the fullest one bounds the run.
        free = min(shutil.disk_usage(d).free for d in pages.roots) * len(pages.roots)
        if need > free:
            per_req = need / len(self.requests)
            fit = int(free * 0.95 / per_req)
            raise ValueError(f"the store needs ~{need / 1e9:.1f} GB but {store} has "
                             f"{free / 1e9:.1f} GB free; try --num-requests {fit}")

    def _header(self, store: str) -> dict:
        import psutil
        cfg = self.cfg
        return {
            "schema": SCHEMA,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": {
                **{k: v for k, v in asdict(cfg).items()
                   if k not in ("geometry", "prompt_scale", "time_scale")},
                "runs": list(cfg.runs), "storage_dir": store,
                "prompt_scale": cfg.scales[0], "time_scale": cfg.scales[1],
                "geometry": self.geometry.to_dict(),
                "page_bytes": self.geometry.page_bytes, "host_pool_pages": self.pool_pages,
                "max_in_flight": MAX_IN_FLIGHT, "arrival_scale": self.arrival_scale,
                "compute": asdict(self.compute),
            },
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus_physical": psutil.cpu_count(logical=False),
                        "cpus_logical": psutil.cpu_count(),
                        "ram_bytes": psutil.virtual_memory().total},
            "workload": describe(self.requests),
            "runs": {},
        }

    def warm_up(self, store: str) -> dict:
        """Write every request's cached prefix pages with the mp engine (skipping present ones)."""
        g = self.geometry
        batch = max(1, min(self.pool_pages, WARMUP_BATCH_BYTES // g.page_bytes))
        t0 = time.perf_counter()
        written = present = 0
        with make_engine("mp", EngineConfig(storage_dir=store, num_workers=self.cfg.workers,
                                            host_pool_pages=batch, **self.cfg.engine_options),
                         g) as eng:
            eng.wait_scanned()  # the store's index whole first (decision 110)
            todo = []
            for r in self.requests:
                keys = r.page_keys(self.cfg.page_size)
                have = eng.exists(keys)
                present += have
                todo.extend(keys[have:])
            for i in range(0, len(todo), batch):
                keys = todo[i:i + batch]
                slots = list(range(len(keys)))
                for slot, key in zip(slots, keys):
                    self.pagebytes.fill(eng.host_pool, slot, key)
                op = eng.backup(keys, slots)
                if not eng.wait(op, 600.0) or op.status != "ok":
                    raise RuntimeError(f"warm-up write failed: {op.status} {op.status_counts()}")
                written += len(keys)
            m = eng.metrics()
            workers = m["workers"]
            # What the mp engines' workers were sized from, as the engine found it
            # (hicache_mp.engine.cpubudget, through its metrics: no second reading).
            cpu = {k: v for k, v in m["cpu"].items() if k != "throttle"}
            self.cpu_budget = {**cpu, "workers": workers,
                               "workers_setting": "explicit" if self.cfg.workers else "auto"}
        secs = time.perf_counter() - t0
        nbytes = written * g.page_bytes
        self.log(f"warm-up: wrote {written} pages ({nbytes / 1e6:.0f} MB) in {secs:.1f} s "
                 f"with {workers} mp workers; {present} already in the store")
        return {"pages_written": written, "pages_present": present, "bytes": nbytes,
                "seconds": secs, "gbps": nbytes / secs / 1e9 if secs and written else None}

    def run_backend(self, label: str, store: str) -> RunResult:
        cfg = self.cfg
        sleep0 = label.endswith(SLEEP0)
        backend, yield_ms, options = run_spec(label[:-len(SLEEP0)] if sleep0 else label,
                                              cfg.yield_ms, cfg.fast_file_write_workers)
        direct = None
        if backend == "none":
            keys = [k for r in self.requests for k in r.page_keys(cfg.page_size)]
            engine = InstantStore(keys, self.geometry.page_bytes)
        elif backend == DIRECT:
            engine, direct = self._direct_engines(store)
        else:
            engine = make_engine(backend, EngineConfig(
                storage_dir=store, num_workers=cfg.workers, host_pool_pages=self.pool_pages,
                prefetch_policy=cfg.policy, prefetch_timeout_s=cfg.timeout_s,
                **cfg.engine_options), self.geometry, **options)
        loader = None
        try:
            if backend != "none":
                # The index whole before the clock starts, as the constructor left it
                # before decision 110: this measures serving, not start-up
                # (scripts/bench_startup.py does that).
                engine.wait_scanned()
            if direct is not None:
                direct.reader.wait_scanned()
            loader = self._loader(engine) if backend in ("mp", "file", "fast_file") else None
            extra = f", {engine.metrics()['workers']} workers" if backend == "mp" else ""
            if direct is not None:
                extra = (f", {direct.reader.metrics()['workers']} workers reading {direct.groups} "
                         f"layer groups a page, layers to {direct.device or 'no device'}")
            if backend == "fast_file":
                extra = f", {options['read_workers']} read / {options['write_workers']} write threads"
            if loader is not None:
                extra += f", pages loaded to {loader.device}"
            self.log(f"[{label}] running {len(self.requests)} requests "
                     f"(policy {cfg.policy}{', yield %g ms' % yield_ms if yield_ms else ''}{extra})")
            # After the pool is made (its memory may have pushed store pages out of
            # the page cache), before the clock starts.
            cached = resident_share(open_store(store), engine.namespace, self.requests,
                                    cfg.page_size) if backend != "none" else None
            sched = Scheduler(label, engine, self.requests, SchedulerConfig(
                page_size=cfg.page_size, compute=self.compute, max_in_flight=MAX_IN_FLIGHT,
                arrival_scale=self.arrival_scale, policy=cfg.policy, timeout_s=cfg.timeout_s,
                yield_ms=yield_ms, idle_sleep0=sleep0,
                host_slots=self.pool_pages if direct is None else engine.host_pool.num_pages,
                direct=direct,
                key_salt=f"{self.nonce}.{label}:", verify=cfg.verify,
                page_bytes_gen=self.pagebytes, max_run_s=cfg.max_run_s, loader=loader,
                progress=lambda done, total, t: self._progress(label, engine, done, total, t)))
            res = sched.run()
            res.page_cache = cached
            return res
        finally:
            namespace = getattr(engine, "namespace", None)
            if direct is not None:
                direct.close()
                direct.reader.close()
            engine.close()
            if namespace is not None:
                self._drop_write_backs(store, namespace, label)

    def _progress(self, label: str, engine, done: int, total: int, t: float) -> None:
        line = f"[{label}] {done}/{total} requests done at {t:.1f} s"
        if label != "none":
            line += f"; {engine.metrics()['read_bytes'] / 1e9:.2f} GB prefetched so far"
        self.log(line)

    def _direct_engines(self, store: str):
        """mp-direct's two engines, as the linker makes them: a writer of whole
        pages (the write-backs; an auxiliary, made first) and a reader of layer
        groups (the loads; auto workers get what the writer leaves), with the
        device KV planes its copies fill."""
        # torch with them, as the DeviceLoader in _loader: `hicache-mp --help`
        # and the runs that move no device bytes start without it (0.4 s, not 2).
        from .direct import DirectLoads, device_planes
        cfg, g, groups = self.cfg, self.geometry, self.direct_groups
        common = dict(storage_dir=store, prefetch_policy=cfg.policy,
                      prefetch_timeout_s=cfg.timeout_s, **cfg.engine_options)
        writer = PrefetchEngine(EngineConfig(num_workers=1, host_pool_pages=self._headroom_pages(),
                                             **common), g, aux_workers=1)
        reader = None
        try:
            reader = PrefetchEngine(EngineConfig(num_workers=cfg.workers, read_parts=groups,
                                                 host_pool_pages=groups * self.pool_pages,
                                                 **common), g)
            device = planes = None
            if cfg.device_load != "off":
                import torch
                if torch.cuda.is_available() or cfg.device_load == "on":
                    device = "cuda" if torch.cuda.is_available() else "cpu"
                    planes = device_planes(g, self.pool_pages, device)
            return writer, DirectLoads(reader, groups, cfg.page_size, planes, device,
                                       self.pool_pages)
        except BaseException:
            if reader is not None:
                reader.close()
            writer.close()
            raise

    def _check_direct(self) -> int:
        """mp-direct's layer groups, or a ValueError before any store or worker."""
        from ...device.layered import auto_groups  # torch: see _direct_engines
        g = self.geometry
        if g.layout != "page_first":
            raise ValueError(f"{DIRECT} reads layer groups into page_first slots, as SGLang's "
                             "direct linker does: use --hicache-mem-layout page_first")
        groups = self.cfg.layer_groups or auto_groups(g.num_layers, g.page_bytes)
        try:
            g.layer_part(groups)
        except ValueError as exc:  # names the divisors
            raise ValueError(f"--layer-groups {groups}: {exc}") from None
        return groups

    def _loader(self, engine):
        """A DeviceLoader over the engine (closed with it), or None."""
        mode = self.cfg.device_load
        if mode == "off":
            return None
        import torch
        if mode == "auto" and not torch.cuda.is_available():
            return None
        from hicache_mp.device import DeviceLoader
        loader = DeviceLoader(engine.host_pool, num_device_pages=self.pool_pages, engine=engine)
        # One page through the copy path before the clock starts: its staging
        # buffer, the first launch of each copy kernel (CUDA loads them lazily)
        # and the stream are start-up, not part of the first request's load.
        loader.load_pages([0], [0]).wait(60.0)
        return loader

    def _drop_write_backs(self, store: str, namespace: str, label: str) -> None:
        """Remove a run's write-backs: keyed by this run alone, nothing reads them
        again, and keeping them would grow the store by every run's share."""
        salt, pages = f"{self.nonce}.{label}:", open_store(store)
        for r in self.requests:
            for key in r.computed_page_keys(self.cfg.page_size):
                pages.remove(naming.key_digest(salt + key, namespace))


def _tempdir() -> str:
    import tempfile
    return tempfile.mkdtemp(prefix="hicache_mp-bench-")
