#!/usr/bin/env bash
# The real-stack harness on the GPU box, in one command (about 8 minutes at
# most): installs what the box lacks from .whl/ (made beforehand by
# scripts/device/device_wheels.sh on a machine with PyPI; carry .whl), then runs
# scripts/sglang_stack.py (SGLang's real host pool + HiCacheController on
# nobytes, mp and file, idle and busy, with the 0.5 ms switch-interval remedy
# measured alongside) and writes OUTDIR/stack.json plus OUTDIR/stack.log.
# Ranks (2 and 4, one GPU each on a box with that many) are a separate call,
# `bash scripts/device/device_prod.sh OUTDIR ranks`: with the stack they would not
# fit one call's 10 minutes.
# Usage: scripts/device/device_stack.sh OUTDIR [extra sglang_stack.py args]
set -u
out=${1:?usage: scripts/device/device_stack.sh OUTDIR [sglang_stack.py args]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/../.."
. scripts/device/device_deps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2
nproc
timeout 420 python3 scripts/sglang_stack.py --round-mib 2048 --page-mib 8 --runs 5 \
  --file-round-mib 256 --switch-interval-ms 0.5 --inject-rounds 3 --store /tmp \
  --json "$out/stack.json" "$@" > "$out/stack.log" 2>&1
echo "sglang_stack rc=$? in $((SECONDS - t0))s"
grep -v "^INFO\|Warning\|warnings.warn" "$out/stack.log" | tail -n 40
