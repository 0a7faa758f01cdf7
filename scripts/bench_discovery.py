#!/usr/bin/env python3
"""The scheduler's loop rate on a store of a million page files while another
engine writes into it: discovery by worker probes against the whole-store rescan.

  store    --files page-file names in the fan-out tree (empty files named as
           pages of this engine's namespace: the index, the rescan and the
           evictor see names; made once, kept with --store DIR)
  loop     a pure-Python busy loop standing for SGLang's scheduler (it holds
           the GIL between calls, as the user's did): every iteration some
           Python work and `poll()`; every --exists-every iterations
           `exists()` of the next 16 keys the writer will write (a request
           asking whether its prefix is in the store)
  writer   another engine, in its own process (another rank or node), backing
           up new pages into the same store as fast as it can
  phases   short slices, interleaved (--rounds of each, --phase-s seconds each,
           in a rotating order), so a drift of the box's speed (each slice
           of a few seconds measured it from 216k to 372k it/s on the H200
           box) falls on every phase alike; the writer stays up and is paused
           for the quiet slices:
    quiet      the writer paused: the loop rate with no store activity
    writer     the writer on, this loop asks nothing (exists() not called): what
               the writer's processes take from this machine's cores; on a
               real deployment the writer is another node and this is "quiet"
    probes     the writer on; this engine finds its pages through exists()
               (workers stat the keys the index misses; hicache_mp.engine.discovery)
    rescan     (a second engine, after) the writer on, an engine with
               rescan_interval_s=5, the old way for shared MLA stores (a thread
               of this process walks the store); against its own quiet slices

Printed: median loop rate per phase, and the median over rounds of each
round's ratio to that round's quiet slice. The issue's target is the loop
rate with another engine writing within 0.95 of quiet. On one machine the
writer's processes take cores, so the writer runs off the loop's core
(--writer-cpus). After each engine's slices: how many of the writer's pages
discovery finds (exists() of the writer's whole sequence).
"""
import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time


from hicache_mp import EngineConfig, PageGeometry, PrefetchEngine
from workers import naming

GEOMETRY = dict(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16",
                layout="page_first")  # 8 KiB pages: the writer is metadata-bound, like a big store


FIND_CHECK = 8192


def log(msg: str) -> None:
    print(msg, flush=True)


def engine(store: str, **kw) -> PrefetchEngine:
    return PrefetchEngine(EngineConfig(storage_dir=store, num_workers=1, host_pool_pages=32,
                                       model_name="bench_discovery", **kw),
                          PageGeometry(**GEOMETRY))


def make_store(store: str, files: int) -> None:
    """`files` empty files named as this namespace's pages (made once)."""
    marker = os.path.join(store, f".made-{files}")
    if os.path.exists(marker):
        return
    with engine(store) as e:
        ns = e.namespace
    t0 = time.monotonic()
    made = set()
    for i in range(files):
        path = naming.page_path(store, naming.key_digest(f"old{i}", ns))
        d = os.path.dirname(path)
        if d not in made:
            os.makedirs(d, exist_ok=True)
            made.add(d)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        if i and i % 200_000 == 0:
            log(f"  {i} files ({time.monotonic() - t0:.0f} s)")
    open(marker, "w").close()
    log(f"store: {files} page files in {time.monotonic() - t0:.0f} s")


def loop_core() -> set:
    """The CPU the loop is pinned to and its SMT siblings (one physical core)."""
    cpu = max(os.sched_getaffinity(0))
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    core = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        core.update(range(int(lo), int(hi or lo) + 1))
    return core


def writer(store: str, tag: str, ready, stop, pause, counter, cpus) -> None:
    """Another engine writing new pages, 16 per backup, until told to stop
    (idle while `pause` is set); on `cpus` if given (with its workers, which
    inherit the mask)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    with engine(store) as e:
        ready.set()
        i = 0
        while not stop.is_set():
            if pause.is_set():
                time.sleep(0.002)
                continue
            keys = [f"{tag}{i + j}" for j in range(16)]
            op = e.backup(keys, range(16))
            e.wait(op, 60)
            i += 16
            counter.value = i


def loop(e: PrefetchEngine, seconds: float, exists_every: int, counter, tag: str = "",
         ask: bool = True) -> float:
    """Iterations per second of the stand-in scheduler loop."""
    n = 0
    acc = 0
    end = time.perf_counter() + seconds
    while True:
        for _ in range(exists_every):
            for k in range(40):   # the scheduler's own Python work
                acc += k * k
            e.poll()
            n += 1
        at = counter.value if counter is not None else 0
        if ask:
            e.exists([f"{tag}{at + j}" for j in range(16)])
        if time.perf_counter() >= end:
            break
    return n / seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--files", type=int, default=1_000_000, help="page files in the store")
    p.add_argument("--store", help="store directory to make or reuse (default: a temporary one, "
                                   "removed at the end)")
    p.add_argument("--phase-s", type=float, default=1.0, help="seconds per slice")
    p.add_argument("--rounds", type=int, default=12, help="rounds of interleaved slices (medians)")
    p.add_argument("--exists-every", type=int, default=100,
                   help="loop iterations per exists() call")
    p.add_argument("--writer-cpus", choices=("other", "any"), default="other",
                   help="other: the loop is pinned to one CPU and the writer (standing for "
                        "another node) runs off that physical core and its SMT sibling; any: "
                        "nothing is pinned")
    args = p.parse_args(argv)
    store = args.store or tempfile.mkdtemp(prefix="bench_discovery.")
    try:
        make_store(store, args.files)
        ctx = mp.get_context("spawn")
        rates = {k: [] for k in ("quiet", "writer", "probes", "rescan_quiet", "rescan")}
        ratios = {k: [] for k in ("writer", "probes", "rescan")}
        found = {}
        for name, kw, phases in (("probes", {}, ("quiet", "writer", "probes")),
                                 ("rescan", {"rescan_interval_s": 5.0}, ("rescan_quiet", "rescan"))):
            t0 = time.monotonic()
            with engine(store, **kw) as e:
                log(f"{name} engine: started in {time.monotonic() - t0:.1f} s "
                    f"({e.indexed_pages()} pages indexed by its start-up scan)")
                allowed, writer_cpus = os.sched_getaffinity(0), []
                if args.writer_cpus == "other" and len(allowed) > 2:
                    # This thread only (Linux): the engine's workers, started
                    # above, keep the whole machine, as they would in a server.
                    # The last CPU: the first ones take most of the interrupts.
                    os.sched_setaffinity(0, {max(allowed)})
                    writer_cpus = sorted(allowed - loop_core())
                    log(f"  loop pinned to CPU {max(allowed)}; the writer on CPUs {writer_cpus}")
                tag = f"new-{name}-"
                ready, stop, pause = ctx.Event(), ctx.Event(), ctx.Event()
                counter = ctx.Value("q", 0)
                pause.set()
                w = ctx.Process(target=writer, args=(store, tag, ready, stop, pause, counter,
                                                     writer_cpus))
                w.start()
                try:
                    ready.wait(300)  # its engine's start-up scan is not part of a phase
                    for r in range(args.rounds):
                        got = {}
                        k = r % len(phases)
                        for phase in phases[k:] + phases[:k]:
                            if phase.endswith("quiet"):
                                pause.set()
                                time.sleep(0.05)  # the backup in flight lands first
                            else:
                                pause.clear()
                            got[phase] = loop(e, args.phase_s, args.exists_every,
                                              None if phase.endswith("quiet") else counter,
                                              tag, ask=phase != "writer")
                            rates[phase].append(got[phase])
                        quiet = got[phases[0]]
                        for phase in phases[1:]:
                            ratios[phase].append(got[phase] / quiet)
                        log(f"  round {r}: " + ", ".join(f"{p} {v:,.0f}" for p, v in got.items())
                            + " it/s")
                finally:
                    stop.set()
                    pause.clear()
                    w.join(60)
                    os.sched_setaffinity(0, allowed)
                written = counter.value
                # What discovery finds of it now: exists() of the writer's
                # sequence (its first FIND_CHECK pages: the writer may have
                # written hundreds of thousands), each call finding up to a
                # probe batch more.
                written = min(written, FIND_CHECK)
                keys, seen = [f"{tag}{i}" for i in range(written)], -1
                while seen < written:
                    got_n = e.exists(keys, wait_s=5.0)
                    if got_n == seen:
                        break
                    seen = got_n
                found[name] = (seen, written)
                log(f"  the writer wrote {counter.value} pages; {name}: this engine found "
                    f"{seen} of the first {written} after its slices")
        med = {k: statistics.median(v) for k, v in rates.items() if v}
        log("")
        log(f"store of {args.files:,} page files, {args.rounds} rounds of {args.phase_s:g} s "
            f"slices, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        log("| phase | loop it/s (median) | ÷ its quiet (median of rounds) |")
        log("|---|---|---|")
        for k in ("quiet", "writer", "probes", "rescan_quiet", "rescan"):
            ratio = f"{statistics.median(ratios[k]):.2f}" if ratios.get(k) else "1.00"
            log(f"| {k} | {med[k]:,.0f} | {ratio} |")
    finally:
        if not args.store:
            log(f"removing the temporary store ({args.files:,} files; --store DIR keeps one)")
            shutil.rmtree(store, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
