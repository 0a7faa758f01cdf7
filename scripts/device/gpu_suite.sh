#!/usr/bin/env bash
# Every GPU-machine check and benchmark in one go, for a lent box with a time
# limit: DeviceLoader correctness, H2D rates, prefetch ratios, cold storage
# against raw ceilings, and a small full-geometry long-context run (the
# 20-request run of docs/results.md needs calls of its own: stock `file` alone takes
# about 6 minutes there). Usage: scripts/device/gpu_suite.sh OUTDIR [NUM_REQUESTS]
# Each step has its own time limit, so one slow step cannot eat the others.
# The limits add up to more than the device's 10-minute call; run it with
# the call's full limit and read what came back under OUTDIR. --pin-workers
# is not measured any more: it lost on this VM (docs/results.md, Prefetch engine).
set -u
out=${1:?usage: scripts/device/gpu_suite.sh OUTDIR [NUM_REQUESTS]}
nreq=${2:-6}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
# The scripts import the package from this checkout (the box has no pip install -e).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) ==="
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "rc=$? in $((SECONDS - t0))s"
  tail -n "${TAIL:-25}" "$out/$name.log"
}
echo "=== machine ==="
nproc; (lscpu 2>/dev/null | grep -E "Model name|Thread|Core|Socket|NUMA node\(s\)") || true
echo "thread siblings: $(cat /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | sort -u | tr '\n' ' ')"
step gpu_check 90 python3 scripts/device/gpu_check_device.py
TAIL=20 step bench_h2d 90 python3 scripts/bench_h2d.py --methods auto --json "$out/h2d.json"
TAIL=16 step bench_prefetch 180 python3 scripts/bench_prefetch.py --workers 8 12 15 --pages 1024 --rounds 2 \
  --repeats 3 --storage-dir /tmp/hicache_mp_prefetch --json "$out/prefetch.json"
rm -rf /tmp/hicache_mp_prefetch
TAIL=24 step bench_storage 240 python3 scripts/bench_storage.py --dir /tmp --workers 4 15 --io-depth 1 2 \
  --total-gib 2 --direct-io on off --json "$out/storage.json"
TAIL=12 step long_context 150 python3 scripts/bench_long_context.py --num-requests "$nreq" \
  --storage-dir /tmp/hicache_mp_lc --json "$out/long_context.json"
