"""`hicache-mp bench`: a warm store, then the reference scheduler once per backend on it.

Owns the bench configuration (full scale and `--quick`), host-pool sizing,
the warm-up pass, one measured run per backend (`none`, `file`, `file` with
the yield workaround, `fast_file` at one or more read-thread counts, `mp`) on
the same store, and the figures of each run
(the dicts that the CLI prints and writes as JSON). Must not parse argv
(`hicache_mp.cli`), run the loop (`scheduler`) or format text (`summary`).
"""
from __future__ import annotations

import os
import platform
import secrets
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from hicache_mp import EngineConfig, PageGeometry, make_engine
from workers import naming
from workers.stores import open_store

from .gputime import gpu_figures
from .instant import InstantStore
from .pagecache import resident_share
from .pagebytes import PageBytes
from .scheduler import RunResult, Scheduler, SchedulerConfig
from .summary import summarize
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
SCHEMA = "hicache_mp.bench/1"
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
    workers: int = 0                # 0: auto (physical cores less two for the scheduler's process)
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
    if label not in ("none", "file", "mp"):
        raise ValueError(f"unknown run {label!r}; choose from {ALL_RUNS}")
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
        self.nonce = secrets.token_hex(4)
        self.pagebytes = PageBytes(self.geometry, seed=cfg.seed)

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
            workers = eng.metrics()["workers"]
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
        if backend == "none":
            keys = [k for r in self.requests for k in r.page_keys(cfg.page_size)]
            engine = InstantStore(keys, self.geometry.page_bytes)
        else:
            engine = make_engine(backend, EngineConfig(
                storage_dir=store, num_workers=cfg.workers, host_pool_pages=self.pool_pages,
                prefetch_policy=cfg.policy, prefetch_timeout_s=cfg.timeout_s,
                **cfg.engine_options), self.geometry, **options)
        loader = None
        try:
            loader = self._loader(engine) if backend != "none" else None
            extra = f", {engine.metrics()['workers']} workers" if backend == "mp" else ""
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
                yield_ms=yield_ms, idle_sleep0=sleep0, host_slots=self.pool_pages,
                key_salt=f"{self.nonce}.{label}:", verify=cfg.verify,
                page_bytes_gen=self.pagebytes, max_run_s=cfg.max_run_s, loader=loader,
                progress=lambda done, total, t: self._progress(label, engine, done, total, t)))
            res = sched.run()
            res.page_cache = cached
            return res
        finally:
            namespace = getattr(engine, "namespace", None)
            engine.close()
            if namespace is not None:
                self._drop_write_backs(store, namespace, label)

    def _progress(self, label: str, engine, done: int, total: int, t: float) -> None:
        line = f"[{label}] {done}/{total} requests done at {t:.1f} s"
        if label != "none":
            line += f"; {engine.metrics()['read_bytes'] / 1e9:.2f} GB prefetched so far"
        self.log(line)

    def _loader(self, engine):
        """A DeviceLoader owned by the engine (closed with it), or None."""
        mode = self.cfg.device_load
        if mode == "off":
            return None
        import torch
        if mode == "auto" and not torch.cuda.is_available():
            return None
        from hicache_mp.device import DeviceLoader
        loader = DeviceLoader(engine.host_pool, num_device_pages=self.pool_pages)
        engine.attach_loader(loader)
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


# --- figures -------------------------------------------------------------------
def _mean(values):
    return float(np.mean(values)) if len(values) else None


def op_stats(records) -> dict:
    rates = [r.gbps for r in records if r.gbps is not None and r.ok_pages]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "ops": len(records),
        "pages": int(sum(r.pages for r in records)),
        "ok_pages": int(sum(r.ok_pages for r in records)),
        "bytes": int(sum(r.nbytes for r in records)),
        "gbps_mean": _mean(rates),
        "gbps_p10": float(np.percentile(rates, 10)) if rates else None,
        "gbps_per_op": [round(x, 4) for x in rates],
        "seconds_mean": _mean([(r.done_ns - r.submit_ns) / 1e9 for r in records]),
        "statuses": statuses,
    }


def figures(res: RunResult, page_size: int) -> dict:
    """Every figure of one run (one entry of the report's `runs`)."""
    summary = summarize(res.requests, res.duration_s)
    prefetch, backup = op_stats(res.prefetch), op_stats(res.backups)
    m = res.engine_metrics
    h2d = [(r.h2d_seen_ns - r.done_ns) / 1e6 for r in res.prefetch if r.h2d_seen_ns and r.done_ns]
    gpu = gpu_figures(res)
    extra = {
        "prefetch_gbps_mean": prefetch["gbps_mean"],
        "h2d_after_io_ms_mean": _mean(h2d),
        "prefetch_gbps_p10": prefetch["gbps_p10"],
        "loop_iters_per_s": res.loop_iters / res.duration_s if res.duration_s else None,
        "backup_gbps": backup["gbps_mean"],
        "gpu_start_s": gpu.get("start_s"),
        "gpu_wait_prefetch_s": gpu.get("wait_s", {}).get("prefetch"),
        "gpu_wait_device_s": gpu.get("wait_s", {}).get("device"),
        "loop_late_ms": gpu["late_s"] * 1e3 if "late_s" in gpu else None,
        "page_cache_first": (res.page_cache or {}).get("first_request"),
    }
    return {
        "backend": res.backend, "policy": res.policy, "yield_ms": res.yield_ms,
        "duration_s": res.duration_s, "loop_iters": res.loop_iters,
        "summary": summary, "extra": extra,
        "prefetch": prefetch, "backup": {**backup, "skipped_pages": res.backup_skipped_pages},
        "verify": {"pages_checked": res.verified_pages + len(res.verify_failures),
                   "failures": res.verify_failures},
        "host_slots_low_water": res.slots_low_water,
        "engine": {k: m.get(k) for k in ("workers", "read_gbps", "write_gbps", "read_bytes",
                                         "write_bytes", "worker_busy", "misses", "poll_calls",
                                         "respawns") if k in m},
        "requests": [
            {"rid": r.rid, "prompt_len": r.prompt_len, "output_len": r.output_len,
             "cached_len": r.cached_len, "ttft_s": r.ttft_s, "latency_s": r.latency_s,
             "itl_s": r.itl_s}
            for r in res.requests],
        "batches": {"prefill": sum(1 for b in res.batches if b[0] == "prefill"),
                    "decode": sum(1 for b in res.batches if b[0] == "decode")},
        "gpu": gpu,
        "page_cache": res.page_cache,
    }



def comparison(runs: dict) -> dict:
    """Mean TTFT of each run over the ideal (`none`) and over the best run."""
    base = runs.get("none", {}).get("summary", {}).get("ttft_mean_s")
    means = {k: v["summary"]["ttft_mean_s"] for k, v in runs.items()}
    best = min(means.values()) if means else None
    return {
        "baseline": "none" if base else None,
        "best": min(means, key=means.get) if means else None,
        "ttft_mean_over_baseline": {k: (t / base if base else None) for k, t in means.items()},
        "ttft_mean_over_best": {k: (t / best if best else None) for k, t in means.items()},
    }


def table_rows(runs: dict) -> dict:
    """What `format_comparison` takes: each run's summary merged with its extras."""
    return {k: {**v["summary"], **v["extra"]} for k, v in runs.items()}


def _tempdir() -> str:
    import tempfile
    return tempfile.mkdtemp(prefix="hicache_mp-bench-")


def busy_machine_note(runs: dict, cpus: int | None = None) -> str:
    """A warning when a run shared an oversubscribed machine, or ""."""
    cpus = cpus or os.cpu_count() or 1
    # Only the in-process baselines' runs count: there the bench itself keeps
    # about two threads busy (the loop and a reader), hence the +1; an mp run's
    # own workers would raise the load without hiding anything.
    peak = max((max(v.get("load_avg") or [0]) for v in runs.values()
                if v.get("backend") in ("file", "fast_file")), default=0)
    if peak <= cpus + 1:
        return ""
    return (f"Note: this machine was busy (1-minute load average up to {peak:.1f} on {cpus} "
            f"CPUs). The in-process baselines are starved of the GIL only while the scheduler "
            f"thread has a CPU to take it back at once, as on a serving host; with every CPU "
            f"busy they look faster than they are. Re-run on a quiet machine for the real gap.")


# The config keys that define the workload and what a run measures: reports that
# differ in any of them do not belong in one table.
SAME_WORKLOAD = ("num_requests", "seed", "quick", "page_size", "layout", "dtype", "policy",
                 "timeout_s", "prompt_scale", "time_scale", "geometry", "device_load")


def merge_reports(reports: list[dict]) -> dict:
    """One report from several of the same workload (each run in its own call):
    their runs side by side, in the order given, and the comparison recomputed."""
    if not reports:
        raise ValueError("nothing to merge")
    first = reports[0]
    runs: dict = {}
    for rep in reports:
        if rep.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} report: schema {rep.get('schema')!r}")
        for key in SAME_WORKLOAD:
            if rep["config"].get(key) != first["config"].get(key):
                raise ValueError(f"reports differ in {key}: {first['config'].get(key)!r} vs "
                                 f"{rep['config'].get(key)!r}; they are not one workload")
        for label, run in rep["runs"].items():
            if label in runs:
                raise ValueError(f"run {label!r} is in more than one report")
            runs[label] = run
    merged = {**first, "runs": runs, "merged_from": [r.get("created") for r in reports],
              "warmup": [r.get("warmup") for r in reports]}
    merged["config"] = {**first["config"], "runs": list(runs)}
    merged["comparison"] = comparison(runs)
    return merged
