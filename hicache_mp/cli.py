"""The `hicache-mp` command line. Subcommands `bench` (the long-context workload, per
backend) and `import-sglang` (convert an SGLang `file` store;
hicache_mp.integrations.sglang.store_import).

Owns argv parsing, progress and result printing, and writing `--json` /
`--plot` files. Must not hold benchmark logic: `hicache_mp.bench.sim.bench` runs it.

`hicache-mp bench` warms one page store, then runs the reference scheduler
(a busy Python loop modelled on SGLang's) over it once per backend:
`none` (all KV already in host memory: the ideal), `file` (SGLang-style
in-process reader thread), `file+yield` (the same with the user's
`sleep(0.001)` workaround), `fast_file` (a replica of SGLang PR #39880's
readv/writev thread pools, `fast_file-r<N>` with N read threads) and `mp`
(this engine). It prints SGLang's
bench_long_context summary per run, then a table with ratios against `none`.

JSON written by `--json PATH` (schema "hicache_mp.bench/1"; times in
seconds, rates in GB/s = 1e9 bytes/s, lengths in tokens):

    schema        "hicache_mp.bench/1"
    created       local time, ISO 8601
    command       argv of this invocation
    config        runs, num_requests, seed, quick, device_load, prompt_scale (1.0 full,
                  0.1 --quick), time_scale (every duration: 1.0 full, 0.2
                  --quick), page_size, layout, dtype,
                  workers (0 = auto), policy, timeout_s, yield_ms,
                  fast_file_write_workers,
                  storage_dir, host_pool_pages, verify, max_run_s,
                  geometry {num_layers, num_kv_heads, head_dim, page_size,
                  dtype, layout, mla}, page_bytes, max_in_flight,
                  arrival_scale, compute {prefill_tokens_per_s,
                  chunk_tokens, decode_s_per_token, time_scale}
    machine       platform, python, cpus_physical, cpus_logical, ram_bytes
    workload      num_requests, prompt_len_{mean,p90,p99},
                  output_len_{mean,p90,p99}, hit_rate (what was generated)
    warmup        pages_written, pages_present, bytes, seconds, gbps
    cpu_budget    what the mp engines' workers were sized from, as the warm-up
                  engine found it (hicache_mp.engine.cpubudget): cpus (whole
                  CPUs this process may keep busy), bound_by (which limit
                  gave them: "physical cores", "HICACHE_MP_NODE_CORES",
                  "affinity" or "cgroup quota"), source (the same in words),
                  host_cores, affinity, quota_cpus (null: no quota), override
                  (HICACHE_MP_NODE_CORES given), workers (what the engine
                  runs), workers_setting ("auto", or "explicit":
                  --hicache-mp-workers N)
    runs.<label>  one per run; label is none | file | file+yield | fast_file | fast_file-r<N> | mp
      backend, policy, yield_ms, duration_s, loop_iters,
                  load_avg [1-minute load average before, after]
      summary     total_requests, prompt_len_{mean,p90,p99},
                  output_len_{mean,p90,p99},
                  ttft_{mean,p90,p99,median,max}_s,
                  itl_{mean,p90,p99,median,max}_s,
                  latency_{mean,p90,p99,median,max}_s,
                  input_token_throughput, output_token_throughput,
                  request_throughput, cache_hit_rate (tokens actually
                  served from the cache / prompt tokens)
      extra       prefetch_gbps_mean, prefetch_gbps_p10 (per prefetch op:
                  landed bytes / submit-to-done time), loop_iters_per_s,
                  backup_gbps (mean per write-back op), h2d_after_io_ms_mean
                  (last page landed -> all its pages seen on the device;
                  null without --device-load); null where a run moved no
                  bytes (none); gpu_start_s, gpu_wait_prefetch_s,
                  gpu_wait_device_s, loop_late_ms (from gpu, below),
                  page_cache_first (from page_cache, below)
      gpu         where the simulated GPU's time went (bench.sim.gputime):
                  start_s (first batch), busy_s, wait_s {prefetch, device,
                  slots, arrival} (idle, by what the loop waited for),
                  late_s, late_max_s (batch ended -> the loop saw it); they
                  sum to duration_s. first_prefetch {rid, pages, submit_s,
                  done_s, on_device_s} (from the run's start)
      page_cache  {first_request, all}: share of those requests' stored
                  prefix bytes in the page cache just before the run (null
                  for none, or where mincore is not there)
      prefetch    ops, pages, ok_pages, bytes, gbps_mean, gbps_p10,
                  gbps_per_op [..], seconds_mean, statuses {ok: n, ...}
      backup      the same fields for write-backs, plus skipped_pages
                  (no free host slot)
      verify      pages_checked (first prefetched page of each request,
                  compared byte for byte with what was written), failures
                  [rid, ...]
      host_slots_low_water   fewest free host slots seen
      engine      workers, read_gbps, write_gbps, read_bytes, write_bytes,
                  worker_busy [fraction per worker], misses, poll_calls,
                  respawns, cpu (mp: the budget as in cpu_budget, with its
                  cgroup's throttle counts over the run) (those the backend
                  reports)
      requests    [{rid, prompt_len, output_len, cached_len, ttft_s,
                  latency_s, itl_s [..], ttft_parts {part: s}}]
      ttft_parts  mean_s {lookup, first_page, read, loop_saw, h2d,
                  gpu_queue, prefill, between_chunks} (the mean over
                  requests of each part of a request's TTFT; they sum to
                  ttft_mean_s: bench.sim.ttftparts), ttft_mean_s
      batches     {prefill: n, decode: n}
    comparison    baseline ("none" or null), best (label),
                  ttft_mean_over_baseline {label: ratio},
                  ttft_mean_over_best {label: ratio}

Exit status: 0, 1 when a prefetched page held the wrong bytes, 2 for a
usage error (a path that cannot be read or written, a bad value: one line
naming it).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

from shm import PageGeometry
from workers.store import split_dirs

from .bench.sim.bench import (ALL_RUNS, SLEEP0, Bench, BenchConfig, busy_machine_note,
                              fast_file_label, merge_reports, table_rows)
from .bench.sim.plot import plot_report
from .bench.sim.report import SCHEMA
from .bench.sim.summary import format_comparison, format_summary, format_verdict
from .bench.sim.ttftparts import format_parts
from .engine.config import add_engine_flags, engine_options
from .integrations.common.identity import model_identity
from .integrations.sglang.layouts import RAW_LAYOUTS
from .integrations.sglang import serve as sglang_serve
from .integrations.sglang.store_import import import_sglang_store, shards_for

BACKEND_CHOICES = ("all", "none", "file", "fast_file", "mp", "mp-direct")
LAYOUTS = ("page_first", "layer_first")


def _worker_counts(text: str) -> tuple:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1 or 1,4, got {text!r}") from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"counts must be distinct and >= 1, got {text!r}")
    return counts


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """Each default in --help; the description and the examples below the
    options as written (argparse would run an example's lines together)."""


# The worker count on the three machines the defaults are for (decision 89):
# auto sizes the I/O workers from what this process may keep busy, the
# cgroup's CPU quota included, so a pod needs no setting of its own.
BENCH_EPILOG = """\
examples, one per machine (the I/O workers: auto by default, sized from the
CPUs this process may use: physical cores, CPU affinity and the cgroup's CPU
quota, less one for the scheduler's process, two above 8 CPUs):
  laptop, 4 cores: auto runs 3 workers
    hicache-mp bench --quick
  bare-metal node shared with other work: count only the cores it may take
  (16: auto runs 14 workers)
    HICACHE_MP_NODE_CORES=16 hicache-mp bench --quick
  small pod, CPU limit 4: auto reads the quota and runs 3 workers; a count of
  your own is used as given (one above the budget is warned of: it gets the
  pod throttled)
    hicache-mp bench --quick --hicache-mp-workers 2
"""
TOP_EPILOG = BENCH_EPILOG + """
the same setting in SGLang: "num_workers" in --hicache-storage-backend-extra-config;
in vLLM: "num_workers" in the tier's dict (0 = auto, as here). `hicache-mp
COMMAND --help` tells each command's options.
"""
IMPORT_EPILOG = """\
examples, one per machine (--workers: 2 by default; 0 = auto, sized from the
CPUs this process may use: physical cores, CPU affinity and the cgroup's CPU
quota, less one for this process, two above 8 CPUs):
  laptop: the default 2 workers
    hicache-mp import-sglang --src /tmp/hicache --dst /mnt/nvme/hicache_mp \\
      --layout page_first --model meta-llama/Llama-3.1-8B-Instruct \\
      --num-layers 32 --num-kv-heads 8 --head-dim 128 --page-size 64
  bare-metal node shared with other work: auto, counting only the cores it may
  take (16: 14 workers)
    HICACHE_MP_NODE_CORES=16 hicache-mp import-sglang ... --workers 0
  small pod, CPU limit 4: auto reads the quota and runs 3 workers
    hicache-mp import-sglang ... --workers 0
"""


def _command(sub, name: str, func, epilog: str | None = None) -> argparse.ArgumentParser:
    """Sub-command `name`'s parser: it runs `func`, shows each default in --help,
    and takes its texts from `func`'s docstring: the first paragraph is the
    help, the rest the description (argparse fills both anew; none under -OO);
    `epilog`, examples after the options."""
    help_line, _, description = inspect.cleandoc(func.__doc__ or "").partition("\n\n")
    p = sub.add_parser(name, formatter_class=_HelpFormatter, help=help_line,
                       description=description, epilog=epilog)
    p.set_defaults(func=func)
    return p


def _bench_parser(sub) -> argparse.ArgumentParser:
    p = _command(sub, "bench", cmd_bench, epilog=BENCH_EPILOG)
    p.add_argument("--quick", action="store_true",
                   help="the same workload at reduced scale, proportions kept: 4 layers x 4 KV "
                        "heads x 64 dims (256 KiB pages), prompts and chunk size x0.1, every "
                        "duration (prefill, decode step, release interval) x0.2; a temp store "
                        "of ~250 MB. Finishes in well under 3 minutes on 2 CPU cores")
    p.add_argument("--hicache-storage-backend", choices=BACKEND_CHOICES, default="all",
                   help="'all' runs none, file, file+yield, fast_file and mp one after another; "
                        "a single name runs only that backend. mp-direct (not in 'all'): SGLang's "
                        "direct L3 path through hicache_mp's linker: no host tier, a request's "
                        "prefix read a layer group at a time when its first chunk runs, the "
                        "forward waiting per layer (docs/design.md, the direct L3 path)")
    p.add_argument("--layer-groups", type=int, default=0, metavar="G",
                   help="mp-direct: layer groups a page is read in (a divisor of the layers); "
                        "0 = the linker's auto rule (groups of at least 1 MiB, at most 8)")
    p.add_argument("--fast-file-read-workers", type=_worker_counts, default="1", metavar="N[,N..]",
                   help="read threads of the fast_file replica (SGLang PR #39880's read_workers); "
                        "a list runs fast_file once per count (e.g. 1,4)")
    p.add_argument("--fast-file-write-workers", type=int, default=1, metavar="N",
                   help="write threads of the fast_file replica (the PR's write_workers)")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    p.add_argument("--hicache-mem-layout", choices=LAYOUTS, default="page_first",
                   help="host pool layout")
    p.add_argument("--storage-dir", default=None,
                   help="page store directory, kept afterwards (default: a temp dir, removed at "
                        "the end). Pages already there are not written again")
    p.add_argument("--scheduler-yield-ms", type=float, default=None, metavar="MS",
                   help="time.sleep(MS/1000) per scheduler loop iteration, the user's workaround. "
                        "Default: 1 ms for the file+yield run of 'all', 0 for a single backend")
    p.add_argument("--num-requests", type=int, default=32,
                   help="requests in the workload (fewer fit a smaller disk; full scale needs "
                        "~2.6 GB of store per request)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--host-pool-pages", type=int, default=0,
                   help="host pool slots per engine; 0 = auto (the hit pages of 24 requests in "
                        "flight plus write-back room, at most 40%% of RAM / free /dev/shm)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write every figure as JSON (schema: the hicache_mp.cli docstring)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="draw TTFT distributions and per-op prefetch GB/s per backend "
                        "(needs matplotlib: pip install -e .[plot])")
    p.add_argument("--scheduler-idle-sleep0", action="store_true",
                   help="every storage run's loop does what SGLang 0.5.23's on_idle does: "
                        "time.sleep(0) in a step with nothing to run while prefetches wait "
                        "(labels get '+sleep0'); off: the loop of earlier SGLang versions")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="run nothing: print one comparison table and verdict from --json reports "
                        "of the same workload run in parts (e.g. one backend per call on a shared "
                        "--storage-dir); --json/--plot then write the merged report")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the byte check of each request's first prefetched page")
    p.add_argument("--device-load", choices=("auto", "on", "off"), default="auto",
                   help="load prefetched pages into a device KV cache through DeviceLoader "
                        "before a request's first prefill chunk (file and mp runs): auto = "
                        "when CUDA is available; on = also on the CPU fallback; off = never")
    add_engine_flags(p)  # every EngineConfig setting that declares a flag (hicache_mp.engine.config)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache-mp", description="GIL-free multiprocess KV prefetch engine tools",
        formatter_class=_HelpFormatter, epilog=TOP_EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    _import_sglang_parser(sub)
    _sglang_serve_parser(sub)
    return parser


# --- sglang-serve (logic: hicache_mp.integrations.sglang.serve) ---------------
def _sglang_serve_parser(sub) -> argparse.ArgumentParser:
    p = _command(sub, "sglang-serve", cmd_sglang_serve)
    p.add_argument("server_args", nargs=argparse.REMAINDER, metavar="-- LAUNCH_SERVER_ARGS",
                   help="everything after -- goes to python -m sglang.launch_server as is")
    return p


def cmd_sglang_serve(args, argv=None) -> int:
    """Run SGLang's own launcher with the HiCache storage fast path opted in

    An alias of `HICACHE_MP_FASTPATH=1 python -m sglang.launch_server
    <args after -->`: the process is replaced by SGLang's launcher, and the
    hicache_mp_fastpath plugin that pip installed with hicache_mp installs the
    fast path in every process SGLang loads plugins in, whatever its front end
    (HTTP, gRPC, Ray, encoder-only). SGLang 0.5.23 only: with any other, the
    plugin logs one error and the server runs on SGLang's stock path. Exits 2
    without starting anything where SGLang would not load the plugin (not
    installed with pip, or left out by SGLANG_PLUGINS). Example:

        hicache-mp sglang-serve -- --model-path Qwen/Qwen3-8B \\
            --enable-hierarchical-cache --hicache-storage-backend file
    """
    rest = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    return sglang_serve.main(rest)


# --- import-sglang (logic: hicache_mp.integrations.sglang.store_import) --------
def _import_sglang_parser(sub) -> argparse.ArgumentParser:
    p = _command(sub, "import-sglang", cmd_import_sglang, epilog=IMPORT_EPILOG)
    p.add_argument("--src", required=True, help="SGLang store (SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR "
                                                "or file_storage_path; default there /tmp/hicache)")
    p.add_argument("--dst", required=True, help="hicache_mp store directory (the backend's storage_dir)")
    p.add_argument("--layout", required=True, choices=RAW_LAYOUTS,
                   help="--hicache-mem-layout of the SGLang server that wrote --src")
    p.add_argument("--model", required=True,
                   help="the model name SGLang used (--served-model-name / model path, as in the "
                        "file names with '/' replaced by '-')")
    p.add_argument("--model-path", default=None,
                   help="the weights the pages belong to, as the server that reads them is "
                        "given them (--model-path: a local directory, fingerprinted, or a hub "
                        "id); default --model (decision 91)")
    p.add_argument("--revision", default=None, help="the server's --revision (hub ids)")
    p.add_argument("--served-model-name", default=None, help="the server's --served-model-name")
    p.add_argument("--weight-version", default=None, help="the server's --weight-version")
    p.add_argument("--namespace", default=None,
                   help='the backend\'s "namespace" extra-config key, where it is set')
    p.add_argument("--tp-size", type=int, default=1, help="SGLang tensor-parallel size")
    p.add_argument("--tp-rank", type=int, default=None, help="import one TP rank (default: all)")
    p.add_argument("--pp-size", type=int, default=1, help="SGLang pipeline-parallel size")
    p.add_argument("--pp-rank", type=int, default=None, help="import one PP rank (default: all)")
    p.add_argument("--mla", action="store_true",
                   help="MLA model (one latent per token, shared by TP ranks): give --num-kv-heads 1 "
                        "and --head-dim kv_lora_rank+qk_rope_head_dim")
    p.add_argument("--num-layers", type=int, required=True, help="layers of one rank's pages")
    p.add_argument("--num-kv-heads", type=int, required=True, help="KV heads per TP rank")
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--page-size", type=int, required=True, help="tokens per page")
    p.add_argument("--dtype", default="bfloat16", help="KV cache dtype")
    p.add_argument("--workers", type=int, default=2,
                   help="I/O worker processes; 0 = auto (the engine's num_workers)")
    p.add_argument("--overwrite", action="store_true", help="rewrite pages already in --dst")
    return p


def cmd_import_sglang(args, argv=None) -> int:
    """convert an SGLang 'file' HiCache store into a hicache_mp store

    Convert the raw page files of SGLang's 'file' storage backend
    (<key>_<model>_<tp_rank>_<tp_size>.bin, no header, in the host layout of
    the server that wrote them) into hicache_mp page files under the namespace
    the SGLang backend HiCacheMP uses, so a warm cache survives the switch.
    Files whose size does not match the geometry, of other models/ranks, or
    already present are skipped and reported. The source is never modified.
    """
    if not os.path.isdir(args.src):
        what = "is not a directory" if os.path.exists(args.src) else "does not exist"
        print(f"hicache-mp import-sglang: --src {args.src} {what}: give the directory of "
              f"SGLang's file store (SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, or "
              f"file_storage_path; by default /tmp/hicache)", file=sys.stderr)
        return 2
    problem = _unusable_dir(args.dst)
    if problem:
        print(f"hicache-mp import-sglang: cannot use --dst {args.dst}: {problem}",
              file=sys.stderr)
        return 2
    geometry = PageGeometry(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
                            head_dim=args.head_dim, page_size=args.page_size, dtype=args.dtype,
                            mla=args.mla)
    shards = shards_for(args.model, tp_size=args.tp_size, tp_rank=args.tp_rank,
                        pp_size=args.pp_size, pp_rank=args.pp_rank, mla=args.mla,
                        identity=model_identity(args.model_path or args.model,
                                                revision=args.revision,
                                                served_name=args.served_model_name,
                                                weight_version=args.weight_version,
                                                namespace=args.namespace))
    print(f"import-sglang: {args.src} ({args.layout}, {geometry.page_bytes} bytes per page) -> "
          f"{args.dst}", flush=True)
    report = import_sglang_store(args.src, args.dst, geometry, args.layout, shards,
                                 workers=args.workers, overwrite=args.overwrite)
    for line in report.lines():
        print(line)
    return 1 if report.failed else 0


def bench_config(args):
    """BenchConfig from parsed `bench` arguments."""
    backend = args.hicache_storage_backend
    fast_files = tuple(fast_file_label(n) for n in args.fast_file_read_workers)
    if args.fast_file_write_workers < 1:
        raise SystemExit("--fast-file-write-workers must be at least 1")
    if backend == "all":
        runs = tuple(r for label in ALL_RUNS
                     for r in (fast_files if label == "fast_file" else (label,)))
        yield_ms = 1.0 if args.scheduler_yield_ms is None else args.scheduler_yield_ms
    elif backend == "file" and args.scheduler_yield_ms:
        runs, yield_ms = ("file+yield",), args.scheduler_yield_ms
    else:
        if args.scheduler_yield_ms:
            raise SystemExit("--scheduler-yield-ms applies to the file backend only")
        runs, yield_ms = (fast_files if backend == "fast_file" else (backend,)), 0.0
    if args.num_requests < 1:
        raise SystemExit("--num-requests must be at least 1")
    if args.layer_groups < 0:
        raise SystemExit("--layer-groups must be 0 (auto) or a divisor of the model's layers")
    if args.scheduler_idle_sleep0:
        runs = tuple(r if r == "none" else r + SLEEP0 for r in runs)
    options = engine_options(args)
    # BenchConfig keeps these three apart: they name its runs in the report.
    workers, policy = options.pop("num_workers"), options.pop("prefetch_policy")
    timeout_s = options.pop("prefetch_timeout_s")
    return BenchConfig(runs=tuple(runs), num_requests=args.num_requests, seed=args.seed,
                       quick=args.quick, page_size=args.page_size, layout=args.hicache_mem_layout,
                       workers=workers, policy=policy, timeout_s=timeout_s, yield_ms=yield_ms,
                       fast_file_write_workers=args.fast_file_write_workers,
                       storage_dir=args.storage_dir, host_pool_pages=args.host_pool_pages,
                       verify=not args.no_verify, device_load=args.device_load,
                       layer_groups=args.layer_groups,
                       engine_options=options)  # the other engine flags, every engine


def cmd_bench(args, argv=None) -> int:
    """run the long-context workload on each storage backend and compare

    Warm a page store, then run the reference scheduler (a busy Python loop
    modelled on SGLang's) on it with each storage backend, print SGLang's
    bench_long_context summary per backend and a comparison table with
    ratios against 'none' (all KV already in host memory).
    """
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install -e .[plot]  (or: pip install matplotlib)",
                  file=sys.stderr)
            return 2
    # Every path checked now, in one line each: not as a traceback, and not
    # after minutes of runs whose figures could then not be written.
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        problem = path and _unwritable_file(path)
        if problem:
            print(f"hicache-mp bench: cannot write {flag} {path}: {problem}", file=sys.stderr)
            return 2
    if args.merge:
        reports = []
        for path in args.merge:
            report, problem = _read_report(path)
            if problem:
                print(f"hicache-mp bench: --merge {path}: {problem}; expected a report "
                      f"written by `hicache-mp bench --json PATH`", file=sys.stderr)
                return 2
            reports.append(report)
        report = merge_reports(reports)
        report["command"] = ["hicache-mp", "bench"] + list(argv or [])
        return _conclude(report, args)
    if args.storage_dir is not None:
        try:  # one clear line now, rather than a traceback from deep inside the warm-up
            problems = [_unusable_dir(d) for d in split_dirs(args.storage_dir)]
        except ValueError as exc:   # one, or a striped list: a malformed list
            problems = [str(exc)]
        if any(problems):
            print(f"hicache-mp bench: cannot use --storage-dir {args.storage_dir}: "
                  f"{next(p for p in problems if p)}", file=sys.stderr)
            return 2
    bench = Bench(bench_config(args))

    def show(label, res, figs):
        print(format_summary(label, figs["summary"], figs["extra"]), flush=True)
        if figs["verify"]["failures"]:
            print(f"[{label}] WRONG BYTES in the first prefetched page of requests "
                  f"{figs['verify']['failures']}", flush=True)

    report = bench.run(on_result=show)
    report["command"] = ["hicache-mp", "bench"] + list(argv or [])
    return _conclude(report, args)


def _unusable_dir(directory: str) -> str:
    """Why `directory` cannot hold pages ("" where it can, made if missing)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        return "it is a file, not a directory"
    except OSError as exc:
        return f"cannot make it ({exc.strerror})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "the directory is not writable by this user"
    return ""


def _unwritable_file(path: str) -> str:
    """Why a file cannot be written at `path` ("" where it can); nothing is made."""
    if os.path.isdir(path):
        return "it is a directory: give a file name"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK) or \
            (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "not writable by this user"
    return ""


def _read_report(path: str) -> tuple[dict | None, str]:
    """(the JSON report at `path`, "") or (None, why it is not one)."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    except ValueError as exc:   # not JSON, or not UTF-8
        return None, f"not JSON ({exc})"
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        return None, f"not a {SCHEMA} report"
    missing = [k for k in ("config", "runs") if not isinstance(report.get(k), dict)]
    if missing:
        return None, f"a {SCHEMA} report without {' or '.join(missing)}"
    return report, ""


def _conclude(report: dict, args) -> int:
    """The comparison table, the verdict, the JSON and the plot of a report."""
    rows = table_rows(report["runs"])
    base = "none" if "none" in rows else next(iter(rows))
    print(f"\nComparison (TTFT/base: mean TTFT over '{base}')")
    print(format_comparison(rows, baseline=base), flush=True)
    verdict = format_verdict(rows)
    if verdict:
        print(verdict, flush=True)
    parts = {k: v["ttft_parts"] for k, v in report["runs"].items() if v.get("ttft_parts")}
    if parts:   # reports made before the breakdown have none to show
        print("\n" + format_parts(parts), flush=True)
    # The CPUs of the machine the runs were measured on (a --merge of reports
    # from a GPU box is printed on another machine).
    note = busy_machine_note(report["runs"], cpus=(report.get("machine") or {}).get("cpus_logical"))
    if note:
        print(note, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    bad = any(r["verify"]["failures"] for r in report["runs"].values())
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, argv[1:])
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"hicache-mp: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
