"""Several ranks on one node through SGLang's real stack, concurrently.

Each rank is its own process, as SGLang runs them: its own GPU (when there
are GPUs), host pool on the "shm" allocator, HiCacheController and hicache_mp
engine with `auto` workers (so the ranks split the node's worker budget,
decision 42), and a pure-Python busy scheduler. First one rank alone, then
all ranks together, started behind a barrier so their rounds overlap (the
lone rank's process, its stack closed, is rank 0 of those). MHA
ranks keep their own pages (TP-suffixed keys). Reports per rank: workers,
median round time and GB/s, the busy loop's it/s, wrong pages; and the
checks of issue 13: workers + schedulers <= cores, each loop rate against
the lone rank's (raw, and each as a share of the same loop's rate timed
alone in its process just before and after its rounds: the box's speed
drifts), aggregate GB/s against the lone rank's.

    python3 scripts/sglang_ranks.py --ranks 2 --round-mib 2048 --page-mib 8 \\
        --runs 5 --json $OUT/ranks.json
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import hicache_mp
from hicache_mp.bench.sglang import stack as S
from hicache_mp.engine.cpubudget import read_budget

# The package's root, for a rank child's PYTHONPATH (a checkout that is not installed).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hicache_mp.__file__)))


RESULT = "result "  # a rank's JSON line starts so (SGLang logs to stdout too)


def rank_main(argv) -> None:
    """A rank's process: import SGLang's stack and say "imported"; then, for each
    {"rank", "ranks", "store"} line on stdin, one rank's run (rank_run). EOF ends it."""
    import torch
    sgl = S.R.import_stack()
    print("imported", flush=True)
    for line in iter(sys.stdin.readline, ""):
        job = json.loads(line)
        if torch.cuda.is_available():
            torch.cuda.set_device(job["rank"] % torch.cuda.device_count())
        out = rank_run(sgl, job["rank"], job["ranks"], job["store"], S.parse(argv))
        print(RESULT + json.dumps(out), flush=True)


def rank_run(sgl, rank: int, ranks: int, store: str, args) -> dict:
    """One rank: set up, say "ready", wait for "go" on stdin, run; its figures."""
    import torch
    if not torch.cuda.is_available() or torch.cuda.device_count() < ranks:
        # fewer GPUs than ranks (a test box): SGLang's adapter counts at most one
        # rank per GPU, so say how many engines share the node
        args.node_engines = ranks
    s = S.Stack(sgl, "mp", args, store, tp_rank=rank, tp_size=ranks)
    try:
        S.backup(s.ctl, s.src, s.tokens, s.hashes, S.Scheduler(False), args.timeout_s)
        s.read(S.Scheduler(False))  # warm
        print("ready", flush=True)
        sys.stdin.readline()
        times, rates = [], []
        # The box's single-thread speed drifts by up to 2x within minutes (a
        # shared VM): the loop is also timed alone, in this process, just
        # before and after its rounds, and compared in those terms too.
        alone = [S.loop_rate_alone(0.3)]
        t0 = time.perf_counter()
        for _ in range(args.runs):
            sched = S.Scheduler(True)
            t, done = s.read(sched, check=False)  # comparing pages is not the rank's load
            times.append(t)
            rates.append(sched.rate())
        span = time.perf_counter() - t0
        alone.append(S.loop_rate_alone(0.3))
        s.read(S.Scheduler(False))  # then one round with every page compared
        gb = s.pages * s.hp.get_size_per_token() * s.P / 1e9
        be = s.ctl.storage_backend
        return {"rank": rank, "workers": getattr(be, "_backend", be).engine.metrics()["workers"],
                "round_s": statistics.median(times), "gbps": gb / statistics.median(times),
                "gb_total": gb * args.runs, "span_s": span, "loop_rate": statistics.median(rates),
                "loop_alone": statistics.mean(alone),
                "loop_share": statistics.median(rates) / statistics.mean(alone),
                "wrong_pages": s.wrong_pages, "checked_pages": s.checked_pages}
    finally:
        s.close()


def _line(p, want) -> str:
    """The next line of rank process `p`'s output that `want` accepts."""
    for line in p.stdout:
        if want(line):
            return line
    raise RuntimeError(f"rank process {p.pid} ended (exit {p.wait()})")


def start_ranks(n: int, rest: list[str]) -> list:
    """n rank processes, each with SGLang's stack imported (the lone run reuses
    the first: an import is most of a rank's start on a small box)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, "-m", "hicache_mp.bench.sglang.ranks", "--rank-child", *rest],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(n)]
    try:
        for p in procs:  # all imported before the lone run: none competes with it
            _line(p, lambda line: line.strip() == "imported")
    except BaseException:
        stop_ranks(procs, kill=True)
        raise
    return procs


def stop_ranks(procs, kill: bool = False) -> None:
    """EOF on its stdin ends each rank's process (`kill`: at once, as after a failure)."""
    for p in procs:
        with contextlib.suppress(OSError):
            p.stdin.close()
    for p in procs:
        try:
            p.wait(0 if kill else 30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_ranks(procs, store: str) -> list[dict]:
    """One run of len(procs) ranks, one in each process, rounds behind a barrier."""
    for i, p in enumerate(procs):
        p.stdin.write(json.dumps({"rank": i, "ranks": len(procs), "store": store}) + "\n")
        p.stdin.flush()
    for p in procs:
        _line(p, lambda line: line.strip() == "ready")
    for p in procs:  # the barrier: every rank set up, then all go
        p.stdin.write("go\n")
        p.stdin.flush()
    return [json.loads(_line(p, lambda line: line.startswith(RESULT))[len(RESULT):])
            for p in procs]


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ranks_at = argv.index("--ranks") if "--ranks" in argv else None
    n = int(argv.pop(ranks_at + 1)) if ranks_at is not None else 2
    if ranks_at is not None:
        argv.pop(ranks_at)
    json_out = None
    if "--json" in argv:
        i = argv.index("--json")
        json_out = argv[i + 1]
        del argv[i:i + 2]
    S.parse(argv)  # bad arguments fail here, before any rank starts
    # The CPUs the ranks' engines size their workers from, read as they read
    # them (HICACHE_MP_NODE_CORES parsed strictly, capped by affinity and the
    # cgroup's quota), so the check below measures against their budget.
    try:
        budget = read_budget()
    except ValueError as exc:  # a bad HICACHE_MP_NODE_CORES: the engines would refuse it too
        print(f"sglang_ranks: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    cores = budget.cpus
    res = {"cores": cores, "cores_source": budget.source, "ranks": n}
    procs = start_ranks(n, argv)
    try:
        with tempfile.TemporaryDirectory(prefix="hicache_mp-ranks-") as root:
            res["lone"] = run_ranks(procs[:1], os.path.join(root, "lone"))[0]
            res["together"] = run_ranks(procs, os.path.join(root, "together"))
    except BaseException:
        stop_ranks(procs, kill=True)
        raise
    stop_ranks(procs)
    lone, tog = res["lone"], res["together"]
    # concurrent ranks: aggregate = all bytes over the longest rank's span
    agg = sum(r["gb_total"] for r in tog) / max(r["span_s"] for r in tog)
    res["check"] = {
        "workers_plus_schedulers": sum(r["workers"] for r in tog) + n,
        "within_cores": sum(r["workers"] for r in tog) + n <= cores,
        "loop_rate_over_lone": [r["loop_rate"] / lone["loop_rate"] for r in tog],
        # each loop's rate over its own rate with no I/O, against the lone rank's
        "loop_share_over_lone": [r["loop_share"] / lone["loop_share"] for r in tog],
        "aggregate_gbps": agg, "lone_gbps": lone["gb_total"] / lone["span_s"],
        "aggregate_over_lone": agg / (lone["gb_total"] / lone["span_s"]),
        "wrong_pages": sum(r["wrong_pages"] for r in tog) + lone["wrong_pages"],
        "checked_pages": sum(r["checked_pages"] for r in tog) + lone["checked_pages"],
    }
    print(json.dumps(res["check"], indent=1), flush=True)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-child":
        rank_main(sys.argv[2:])
        # Its JSON is out and its stack closed: the parent waits for its exit,
        # which the interpreter's teardown of torch and SGLang would hold up ~2 s.
        sys.stdout.flush()
        os._exit(0)
    else:
        main()
