#!/usr/bin/env bash
# SGLang's direct L3 path (issue 44) on the GPU box, in one command: installs
# what the box lacks from .whl/ (scripts/device/device_wheels.sh) and the
# sglang-fs-linker wheel from .whl-fslinker/ (pip download --no-deps
# sglang-fs-linker==0.1.0 -d .whl-fslinker), then runs scripts/bench_linker.py:
# a 2 GiB prefix (256 x 8 MiB pages, 32 layers) on a warm store, the layered
# linker at 8, 16 and 32 groups beside one group (load everything, then
# compute) and sglang-fs-linker, interleaved rounds, into OUTDIR/linker.json and OUTDIR/linker.log.
# Carry: .whl .whl-fslinker
# Usage: [NO_STACK=1] scripts/device/device_linker.sh OUTDIR [bench_linker.py args]
set -u
out=${1:?usage: scripts/device/device_linker.sh OUTDIR [bench_linker.py args]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/../.."
. scripts/device/device_deps.sh
export PYTHONPATH=$PWD/scripts/device:$PYTHONPATH  # fs_linker_compat, as SGLang's factory imports it
if ls .whl-fslinker/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target "$deps" .whl-fslinker/*.whl && fs=--fs-linker
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -2
nproc
# 8, 16 and 32 layer groups (4, 2 and 1 layers a group), one group and
# sglang-fs-linker, interleaved in the same rounds.
timeout 360 python3 scripts/bench_linker.py --rounds 5 --store /tmp --groups 8,16,32 ${fs:-} \
  --json "$out/linker.json" "$@" > "$out/linker.log" 2>&1
echo "bench_linker rc=$? in $((SECONDS - t0))s"
grep -v "^INFO\|Warning\|warnings.warn\|^hicache_mp: " "$out/linker.log" | tail -n 9
# Beside it, SGLang's HiCache path with mp for the same 2 GiB: storage -> host
# through SGLang's real HiCacheController (its own layer-wise H2D follows).
[ "${NO_STACK:-0}" = 1 ] && exit 0  # NO_STACK=1: the linker alone
timeout 150 python3 scripts/sglang_stack.py --backends mp --round-mib 2048 --page-mib 8 \
  --runs 3 --no-mixed --no-trace --store /tmp --json "$out/stack.json" > "$out/stack.log" 2>&1
echo "sglang_stack rc=$? in $((SECONDS - t0))s"
grep -v "^INFO\|Warning\|warnings.warn" "$out/stack.log" | tail -n 12
