#!/usr/bin/env bash
# Issue 35's figures on the GPU box in one call (about 7-8 minutes): installs
# what the box lacks from .whl/ (scripts/device/device_deps.sh; carry .whl),
# then runs scripts/sglang_fastpath_bench.py three times: dense
# (HiCacheController: the sleeping floor, mp and SGLang's file backend, 2 GiB
# rounds of 8 MiB pages, file at FILE_MIB) and hybrid (HybridCacheController:
# Mamba, SWA, DSA at 64 and 256 KV pages), each stock against the fast path,
# interleaved, RUNS runs; then the busy GIL trace alone (2 traced rounds per
# variant). Each part has its own time limit (DENSE_S, HYBRID_S, TRACE_S) and
# writes its JSON as it goes, so a part cut short still leaves what it
# measured (on 2026-12-05 the trace, then inside the dense part, was cut).
# Usage: scripts/device/device_fastpath.sh OUTDIR [RUNS] [FILE_MIB]
set -u
out=${1:?usage: scripts/device/device_fastpath.sh OUTDIR [RUNS] [FILE_MIB]}
runs=${2:-5}
file_mib=${3:-512}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
. scripts/device/device_deps.sh
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1; nproc
t1=$SECONDS
timeout "${DENSE_S:-200}" python3 scripts/sglang_fastpath_bench.py --runs "$runs" \
  --file-round-mib "$file_mib" --geometries '' --no-trace --store /tmp \
  --json "$out/fastpath-dense.json" > "$out/fastpath-dense.log" 2>&1
echo "== dense rc=$? in $((SECONDS - t1))s"
grep "^| \|busy loop alone\|per batch\|GIL tracer\|Tensor.item\|wrong_pages" "$out/fastpath-dense.log" | head -n 40
grep -B2 -A8 "^Traceback" "$out/fastpath-dense.log" | tail -n 12
t1=$SECONDS
timeout "${HYBRID_S:-200}" python3 scripts/sglang_fastpath_bench.py --runs "$runs" \
  --backends '' --no-trace --store /tmp \
  --json "$out/fastpath-hybrid.json" > "$out/fastpath-hybrid.log" 2>&1
echo "== hybrid rc=$? in $((SECONDS - t1))s"
grep "^| \|busy loop alone\|wrong_pages" "$out/fastpath-hybrid.log" | head -n 40
grep -B2 -A8 "^Traceback" "$out/fastpath-hybrid.log" | tail -n 12
t1=$SECONDS
# the busy GIL trace alone: 2 traced rounds of each variant's dense and hybrid mp stack
timeout "${TRACE_S:-120}" python3 scripts/sglang_fastpath_bench.py --runs 1 --backends '' \
  --geometries '' --trace-runs 2 --store /tmp \
  --json "$out/fastpath-trace.json" > "$out/fastpath-trace.log" 2>&1
echo "== trace rc=$? in $((SECONDS - t1))s"
grep "GIL tracer\|Tensor.item" "$out/fastpath-trace.log" | head -n 12
grep -B2 -A8 "^Traceback" "$out/fastpath-trace.log" | tail -n 12
exit 0
