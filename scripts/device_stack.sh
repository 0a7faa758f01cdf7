#!/usr/bin/env bash
# The real-stack harness on the GPU box, in one command (about 8 minutes at
# most): installs what the box lacks from .whl/ (made beforehand by
# scripts/device_wheels.sh on a machine with PyPI; carry .whl), then runs
# scripts/sglang_stack.py (SGLang's real host pool + HiCacheController on
# nobytes, mp and file, idle and busy, with the 0.5 ms switch-interval remedy
# measured alongside) and writes OUTDIR/stack.json plus OUTDIR/stack.log; on a
# box with 2 or more GPUs also scripts/sglang_ranks.py with 2 and 4 ranks
# (OUTDIR/ranks2.json, ranks4.json: the node-wide worker budget under load).
# Usage: scripts/device_stack.sh OUTDIR [extra sglang_stack.py args]
set -u
out=${1:?usage: scripts/device_stack.sh OUTDIR [sglang_stack.py args]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
. scripts/device_deps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2
nproc
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
limit=420; [ "$gpus" -ge 2 ] && limit=260
timeout $limit python3 scripts/sglang_stack.py --round-mib 2048 --page-mib 8 --runs 5 \
  --file-round-mib 256 --switch-interval-ms 0.5 --inject-rounds 3 --store /tmp \
  --json "$out/stack.json" "$@" > "$out/stack.log" 2>&1
echo "sglang_stack rc=$? in $((SECONDS - t0))s"
grep -v "^INFO\|Warning\|warnings.warn" "$out/stack.log" | tail -n 40
if [ "$gpus" -ge 2 ]; then
  for n in 2 4; do
    timeout 100 python3 scripts/sglang_ranks.py --ranks $n --round-mib 2048 --page-mib 8 \
      --runs 3 --inject-rounds 0 --json "$out/ranks$n.json" > "$out/ranks$n.log" 2>&1
    echo "sglang_ranks $n rc=$? in $((SECONDS - t0))s"
    grep -v "^INFO\|Warning\|warnings.warn" "$out/ranks$n.log" | tail -n 14
  done
fi
