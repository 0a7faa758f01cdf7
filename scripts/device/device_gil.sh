#!/usr/bin/env bash
# Issue-22 figures on the GPU box: the GIL-hold test on the box's numpy, the
# real SGLang stack (2 concurrent requests a round, nobytes floor interleaved
# with mp, idle and busy, GIL tracer), the hybrid harness (scripts/
# device_hybrid.sh: SGLang's HybridCacheController), the main job's
# 20-request TTFT (none and mp) and bench_prefetch. Needs .whl
# (scripts/device/device_wheels.sh) carried. STEPS picks steps (default: all but
# hybrid, which fits one call only with a few of the others).
# Usage: [STEPS="gil_hold stack hybrid lc prefetch"] scripts/device/device_gil.sh OUTDIR
set -u
out=${1:?usage: scripts/device/device_gil.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
# lc and prefetch need only posix_ipc: a call that carries .whl-vllm instead
# (scripts/device/device_vllm.sh installs it) sets DEPS_DIR to that install
if [ -n "${DEPS_DIR:-}" ]; then export PYTHONPATH=$PWD:$DEPS_DIR${PYTHONPATH:+:$PYTHONPATH}
else . scripts/device/device_deps.sh; fi
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; nproc
python3 -c "import numpy, sys; print('numpy', numpy.__version__, 'python', sys.version.split()[0])"
step() {  # name limit cmd...: run, log to $out/name.log, say how it went
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0))s"
}
steps=" ${STEPS:-gil_hold stack lc prefetch} "
want() { [[ $steps == *" $1 "* ]]; }
if want gil_hold; then
step gil_hold 60 python3 -m pytest -q -p no:cacheprovider tests/test_gil_hold.py
tail -n 4 "$out/gil_hold.log"
fi
if want stack; then
step stack 240 python3 scripts/sglang_stack.py --backends nobytes,mp --round-mib 2048 --page-mib 8 \
  --requests 2 --runs 21 --trace-runs 2 --inject-rounds 0 --no-mixed --store /tmp --json "$out/stack.json"
grep -v "^INFO\|Warning\|warnings.warn\|^{\"backend\|^sglang_real\|^sgl_kernel" "$out/stack.log" | tail -n 42
grep -o '"wakeups_per_batch_get": {[^}]*}' "$out/stack.log" | tail -n 1
fi
if want hybrid; then
  bash scripts/device/device_hybrid.sh "$out"
fi
if want lc; then
for b in none mp; do
  step "lc_$b" 100 python3 scripts/bench_long_context.py --num-requests 20 \
    --hicache-storage-backend "$b" --storage-dir /tmp/hicache_mp_lc --json "$out/lc_$b.json"
  grep -i "ttft\|GB/s (mean)\|loop it/s" "$out/lc_$b.log" | tail -n 6
done
fi
if want prefetch; then
step prefetch 110 python3 scripts/bench_prefetch.py --workers 14 --pages 1024 --rounds 2 \
  --repeats 3 --storage-dir /tmp/hicache_mp_prefetch --json "$out/prefetch.json"
tail -n 12 "$out/prefetch.log"
fi
