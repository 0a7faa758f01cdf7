#!/usr/bin/env bash
# The vLLM tier's figures on the GPU box, in one command (about 5 minutes on
# 16 cores; its timeouts add up to 9 min 10 s): installs from .whl-vllm/ (made
# beforehand by scripts/device/device_vllm_wheels.sh on a machine with PyPI; carry
# .whl-vllm) the wheels into $deps and the stripped vLLM into /tmp/vllm, marked +cpu so vLLM
# takes its CPU platform (the tier moves no GPU bytes; no CUDA platform init),
# then runs
#  - scripts/bench_vllm_tier.py: 2 MiB rows (Llama-3.1-8B, one 16-token
#    block), idle and pure-Python busy scheduler loops, warm and cold
#    (O_DIRECT) I/O, this tier on auto workers against vLLM's fs tier with its
#    C helper (.whl-vllm/fs_io_C.abi3.so) at 4, 16 and 64 threads and its
#    Python fallback at 4 and 16, the loop's rate, every byte checked, 2,000
#    lookups -> OUTDIR/vllm.json, OUTDIR/vllm.log (a row's JSON line is
#    logged as it ends: a run cut off by its timeout keeps those);
#  - scripts/bench_vllm_capacity.py: this tier under storage_max_bytes of
#    3/8 x ROWS pages, 4 rounds of ROWS/4 new pages -> OUTDIR/vllm_capacity.json,
#    OUTDIR/vllm_capacity.log;
# and prints the summary. It does not source scripts/device/device_deps.sh: that is
# SGLang's (.whl/), which this run neither needs nor can carry beside this.
# Usage: scripts/device/device_vllm.sh OUTDIR [ROWS [REPEATS]]   (ROWS: rows per phase,
# default 2048 = 4 GiB, lowered to what /dev/shm holds; REPEATS: interleaved
# rounds of every tier row, medians in the table, default 1)
set -u
out=${1:?usage: scripts/device/device_vllm.sh OUTDIR [ROWS]}
rows=${2:-2048}
repeats=${3:-1}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/../.."
whl=.whl-vllm
deps=${HICACHE_MP_DEVICE_DEPS:-/tmp/hicache_mp_vllm_deps}
export PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cpu
t0=$SECONDS
test -f "$whl/vllm-0.33.0-stripped.tar.gz" || { echo "no $whl: run scripts/device/device_vllm_wheels.sh and carry $whl"; exit 3; }
# A warm machine keeps both from the call before.
if [ ! -f "$deps/.installed" ]; then
  rm -rf "$deps" && mkdir -p "$deps"
  timeout 90 python3 -m pip install -q --no-deps --no-index --no-compile --no-cache-dir \
    --target "$deps" "$whl"/*.whl > "$out/install.log" 2>&1 ||
    { tail -n 20 "$out/install.log"; echo "install failed"; exit 3; }
  touch "$deps/.installed"
fi
if [ ! -f /tmp/vllm/.installed ]; then
  rm -rf /tmp/vllm && mkdir -p /tmp/vllm
  tar -xzf "$whl/vllm-0.33.0-stripped.tar.gz" -C /tmp/vllm || { echo "untar failed"; exit 3; }
  sed -i 's/^Version: 0.33.0$/Version: 0.33.0+cpu/' /tmp/vllm/vllm-0.33.0.dist-info/METADATA
  touch /tmp/vllm/.installed
fi
export PYTHONPATH=/tmp/vllm:$deps:$PWD
echo "install: $((SECONDS - t0))s"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2
echo "nproc $(nproc)"
timeout 60 python3 - "$whl/fs_io_C.abi3.so" <<'EOF' 2>&1 | grep -v "^Triton\|vllm._C"
import importlib.metadata as md, importlib.util, platform, sys
import numpy, torch
print("python", platform.python_version(), "numpy", numpy.__version__, "torch", torch.__version__,
      "cuda", torch.version.cuda)
print("vllm", md.version("vllm"), "transformers", md.version("transformers"),
      "huggingface_hub", md.version("huggingface_hub"))
import vllm
from vllm.platforms import current_platform
print("vllm from", vllm.__file__, "platform", type(current_platform).__name__)
spec = importlib.util.spec_from_file_location("vllm.fs_io_C", sys.argv[1])
try:
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    print("fs helper: loads")
except Exception as exc:  # the bench would stop on it: it runs Python rows only then
    print(f"fs helper: DOES NOT LOAD ({exc!r}): fs rows are Python only")
    sys.exit(4)
EOF
helper_rc=${PIPESTATUS[0]}
helper=(--fs-helper "$whl/fs_io_C.abi3.so")
[ "$helper_rc" = 4 ] && helper=()
[ "$helper_rc" = 0 ] || [ "$helper_rc" = 4 ] || { echo "import check failed (rc $helper_rc)"; exit 3; }
# The CPU tier (2 x rows x 2 MiB) lives in /dev/shm: at most half of what is free.
shm_rows=$(( $(df -k --output=avail /dev/shm | tail -1) / 1024 / 2 / 4 ))
[ "$shm_rows" -lt "$rows" ] && { echo "/dev/shm holds $shm_rows rows a phase, not $rows"; rows=$shm_rows; }
[ "$rows" -ge 64 ] || { echo "/dev/shm too small: $rows rows"; exit 3; }
df -h /dev/shm /tmp | tail -n 2
store=/tmp/hicache_mp_vllm_bench
rm -rf "$store"
t1=$SECONDS
timeout -k 10 320 python3 scripts/bench_vllm_tier.py --rows "$rows" --store "$store/tier" \
  ${helper[@]+"${helper[@]}"} --fs-threads 4,16,64 --fs-py-threads 4,16 --io warm,cold \
  --modes idle,busy --lookup-keys 2000 --phase-timeout-s 40 --repeats "$repeats" \
  --json "$out/vllm.json" > "$out/vllm.log" 2>&1
echo "bench_vllm_tier rc=$? in $((SECONDS - t1))s (rows $rows)"
t1=$SECONDS
timeout -k 10 80 python3 scripts/bench_vllm_capacity.py --rows $((rows / 4)) --rounds 4 \
  --limit-rows $((rows * 3 / 8)) --gap-s 1 --store "$store/capacity" --phase-timeout-s 40 \
  --json "$out/vllm_capacity.json" > "$out/vllm_capacity.log" 2>&1
echo "bench_vllm_capacity rc=$? in $((SECONDS - t1))s"
rm -rf "$store"
# The summary: the table, ratios, lookups and bytes (everything after the
# per-row JSON lines), then the capacity line; errors if there is no table.
grep -qE "^(medians of .*; )?busy loop with no I/O" "$out/vllm.log" &&
  sed -nE '/^(medians of .*; )?busy loop with no I\/O/,$p' "$out/vllm.log" ||
  { grep -v '^{' "$out/vllm.log" | tail -n 30; }
grep "^capacity:" "$out/vllm_capacity.log" || tail -n 20 "$out/vllm_capacity.log"
echo "total $((SECONDS - t0))s"
