#!/usr/bin/env bash
# Issue-22 hybrid figures on the GPU box in one call (about 3 minutes): installs
# what the box lacks from .whl/ (scripts/device/device_deps.sh; made beforehand by
# scripts/device/device_wheels.sh: carry .whl), then runs scripts/sglang_hybrid_check.py:
# SGLang's real HybridCacheController over its real host pool group for Mamba
# (Qwen3-Next), SWA (gpt-oss) and DSA (DeepSeek-V3.2) geometries, rounds of 2
# concurrent requests of 64 and of 256 KV pages each, mp with the no-bytes
# floor's run right after each, idle and busy, 9 interleaved runs, every KV
# and sidecar page checked, then the GIL tracer's per-call table.
# Writes OUTDIR/hybrid.json (after each geometry too) and OUTDIR/hybrid.log.
# Usage: scripts/device/device_hybrid.sh OUTDIR [extra sglang_hybrid_check.py args]
set -u
out=${1:?usage: scripts/device/device_hybrid.sh OUTDIR [sglang_hybrid_check.py args]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/../.."
. scripts/device/device_deps.sh
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1; nproc
t1=$SECONDS
timeout 230 python3 scripts/sglang_hybrid_check.py --round-pages 64,256 --requests 2 --runs 9 \
  --trace-runs 1 --workers 8 --timeout-s 60 --store /tmp --json "$out/hybrid.json" "$@" \
  > "$out/hybrid.log" 2>&1
echo "== sglang_hybrid_check rc=$? in $((SECONDS - t1))s"
grep "^\[sglang_hybrid_check\|^| " "$out/hybrid.log" | grep -v ":idle |" | head -n 90
grep '"wrong_pages"' "$out/hybrid.log" | tail -n 1
grep -B2 -A8 "^Traceback" "$out/hybrid.log" | tail -n 12 || true
