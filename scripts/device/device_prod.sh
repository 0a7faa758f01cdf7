#!/usr/bin/env bash
# Issue 13's node-level figures on the GPU box, in one command (each part
# time-limited; ~9 minutes for all): installs what the box lacks from .whl/
# (scripts/device/device_wheels.sh; carry .whl), then runs the parts named (all by
# default):
#   ranks      scripts/sglang_ranks.py with 2 and 4 ranks, each its own process,
#              host pool, HiCacheController and engine (auto workers: the
#              node-wide budget), one GPU each where there are enough, under
#              pure-Python busy schedulers (OUTDIR/ranks2.json, ranks4.json)
#   storage    scripts/bench_storage.py, O_DIRECT, cold: write-through and reads
#              against honest raw ceilings (1-64 plain threads and processes,
#              one new file per page, the best of them), io depth 2 and 4, and
#              reads beside a write-through (OUTDIR/storage.json)
#   mixed      (only when named) scripts/bench_storage.py --mixed-only: reads
#              alone and beside a backup stream, in turn, 15 workers, from the
#              page cache (buffered) and cold (O_DIRECT): the medians of 5
#              pairs' ratios (OUTDIR/mixed.json; ~2 minutes)
#   discovery  scripts/bench_discovery.py on a store of 1 M page files: the
#              scheduler's loop rate quiet / another engine writing (found by
#              probes) / the old whole-store rescan, in 16 rounds of
#              interleaved 1 s slices (OUTDIR/discovery.log)
# Usage: scripts/device/device_prod.sh OUTDIR [ranks] [storage] [mixed] [discovery]
set -u
out=${1:?usage: scripts/device/device_prod.sh OUTDIR [ranks] [storage] [mixed] [discovery]}
shift
parts=${*:-ranks storage discovery}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
. scripts/device/device_deps.sh
nvidia-smi -L 2>/dev/null
nproc
quiet() { grep -v "^INFO\|Warning\|warnings.warn" "$1" | tail -n "$2"; }
for part in $parts; do
  case $part in
    ranks)
      for n in 2 4; do
        timeout $((60 + 60 * n)) python3 scripts/sglang_ranks.py --ranks $n --round-mib 2048 --page-mib 8 \
          --runs 3 --inject-rounds 0 --json "$out/ranks$n.json" > "$out/ranks$n.log" 2>&1
        echo "sglang_ranks $n rc=$? at $((SECONDS - t0))s"
        quiet "$out/ranks$n.log" 14
      done ;;
    storage)
      timeout 200 python3 scripts/bench_storage.py --dir /tmp --workers 15 --io-depth 2 4 \
        --total-gib 4 --direct-io on --raw-threads 1 16 32 64 --no-dd \
        --json "$out/storage.json" > "$out/storage.log" 2>&1
      echo "bench_storage rc=$? at $((SECONDS - t0))s"
      quiet "$out/storage.log" 30 ;;
    mixed)
      timeout 240 python3 scripts/bench_storage.py --dir /tmp --workers 15 --total-gib 6 \
        --direct-io off on --mixed-only --mixed-passes 8 --mixed-repeats 5 \
        --json "$out/mixed.json" > "$out/mixed.log" 2>&1
      echo "bench_storage mixed rc=$? at $((SECONDS - t0))s"
      quiet "$out/mixed.log" 30 ;;
    discovery)
      timeout 300 python3 scripts/bench_discovery.py --files 1000000 --phase-s 1 --rounds 16 \
        > "$out/discovery.log" 2>&1
      echo "bench_discovery rc=$? at $((SECONDS - t0))s"
      quiet "$out/discovery.log" 20 ;;
    *) echo "unknown part $part (ranks, storage, mixed, discovery)"; exit 2 ;;
  esac
done
