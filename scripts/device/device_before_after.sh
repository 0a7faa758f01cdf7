#!/usr/bin/env bash
# Issue 25's check that the redesign changed no figure: bench_prefetch and the
# SGLang stack harness, each at a "before" tree and at this one, interleaved
# in one call on the GPU box (before, after, before, after). Both trees run
# this tree's scripts and bench harness (hicache_mp/bench's loop, tracer and
# rigs, copied over the before tree's), so only the engine differs: the stack harness changed since (2 requests per round, the
# tracer). The before tree travels as a tar (made here with
# `git archive REV > .before/before.tar`; .before/ is ignored, carry it with
# .whl). Usage: scripts/device/device_before_after.sh OUTDIR prefetch|stack [RUNS]
# Each run leaves a log and a JSON in OUTDIR: keep OUTDIR off $OUT and tar it
# there (a device call brings back at most 8 files). A prefetch run takes
# about 2 minutes, a stack run about 1.5: RUNS=2 of both is over one call.
set -u
out=${1:?usage: scripts/device/device_before_after.sh OUTDIR prefetch|stack [RUNS]}
what=${2:?prefetch or stack}
runs=${3:-2}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
after=$PWD
before=/tmp/hicache_mp_before
rm -rf "$before" && mkdir -p "$before" && tar -xf .before/before.tar -C "$before" || exit 3
cp -r scripts/. "$before/scripts/" || exit 3
# The harness the scripts run (busy loop, tracer, rigs) lives in the package; the
# baselines beside it (bench/baseline.py, fast_file.py) build on the engine: the before tree keeps its own.
for h in loop.py giltrace.py sglang vllm; do cp -r "hicache_mp/bench/$h" "$before/hicache_mp/bench/" || exit 3; done
if [ "$what" = stack ]; then . scripts/device/device_deps.sh; else
  python3 -m pip install -q --no-deps --no-index --target /tmp/pi .whl/posix_ipc*.whl || exit 3
  deps=/tmp/pi; export PYTHONUNBUFFERED=1; fi
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; nproc
one() {  # tree label n
  local tree=$1 label=$2 n=$3 t0=$SECONDS log="$out/$what-$2-$3.log"
  cd "$tree"
  if [ "$what" = prefetch ]; then
    PYTHONPATH=$tree:$deps timeout 200 python3 scripts/bench_prefetch.py --workers 14 \
      --pages 1024 --rounds 2 --repeats 3 --storage-dir "/tmp/ba_$label" \
      --json "$out/$what-$label-$n.json" > "$log" 2>&1
  else
    PYTHONPATH=$tree:$deps timeout 200 python3 scripts/sglang_stack.py --backends nobytes,mp \
      --round-mib 2048 --page-mib 8 --runs 7 --inject-rounds 0 --no-mixed --store /tmp \
      --json "$out/$what-$label-$n.json" > "$log" 2>&1
  fi
  echo "== $what $label #$n rc=$? in $((SECONDS - t0))s"
  grep -v "^INFO\|Warning\|warnings.warn\|^{\"backend\|^sglang_real\|^sgl_kernel" "$log" | tail -n 14
  cd "$after"
}
for n in $(seq 1 "$runs"); do one "$before" before "$n"; one "$after" after "$n"; done
