#!/usr/bin/env bash
# The hybrid (v2) prefetch check on the GPU box, in one command (a few minutes):
# installs what the box lacks from .whl/ exactly as scripts/device_stack.sh does
# (made beforehand by scripts/device_wheels.sh on a machine with PyPI; carry
# .whl), then runs scripts/sglang_hybrid_check.py (SGLang's real MHA KV and
# Mamba host pools, Qwen3-Next-like geometry, mp against file, idle and with
# a pure-Python busy scheduler, every page checked) and writes
# OUTDIR/hybrid.json plus OUTDIR/hybrid.log.
# Usage: scripts/device_hybrid.sh OUTDIR [extra sglang_hybrid_check.py args]
set -u
out=${1:?usage: scripts/device_hybrid.sh OUTDIR [sglang_hybrid_check.py args]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
. scripts/device_deps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2
nproc
timeout 480 python3 scripts/sglang_hybrid_check.py --runs 3 --workers 8 \
  --json "$out/hybrid.json" "$@" > "$out/hybrid.log" 2>&1
echo "sglang_hybrid_check rc=$? in $((SECONDS - t0))s"
grep "sglang_hybrid_check" "$out/hybrid.log" | tail -n 20
