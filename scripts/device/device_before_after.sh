#!/usr/bin/env bash
# Issue 25's check that the redesign changed no figure: one benchmark at a
# "before" tree (git commit 05859c4, the last before the package was split
# into engine/, device/, bench/...) and at this one, interleaved in one call
# (before, after, before, after, ...), then a table of the figures per run
# and after/before of their medians (scripts/device/before_after_summary.py).
#
# What each tree runs -- only the engine differs:
#  prefetch  this tree's scripts/bench_prefetch.py in both. Its busy loop and
#            what it measures are the before tree's own, line for line: the
#            redesign moved `_scheduler_step`/`idle_loop_rate` verbatim into
#            hicache_mp/bench/loop.py and made a baseline that moves nothing
#            in its cap a None ratio (the before script divides by zero there,
#            a risk with the short --file-cap-s used here). So the before tree
#            gets this script with one import rewritten (auto_workers from
#            hicache_mp.config, where it lived) and bench/loop.py beside it.
#            Workers: auto (--workers 0) in both trees, each its own
#            auto_workers (both pick 14 on the 16-core box; that also answers
#            "no CPU quota: GB/s and loop rate within 5% of the old auto").
#            The file/fast_file baselines are cut to --file-cap-s 2: not
#            compared. Each tree keeps its store in /tmp/ba_store_<tree>
#            (written by its first run, read by the rest; removed at the end).
#  stack     this tree's SGLang stack harness (scripts/sglang_stack.py ->
#            hicache_mp/bench/sglang/, giltrace.py, loop.py) copied over the
#            before tree's, which had none in the package (the harness since
#            gained 2 requests a round and the tracer); it reaches the engine
#            only through SGLang's dynamic backend (hicache_mp.integrations
#            .sglang, the same path in both). Backends nobytes,mp, no tracer.
#  vllm      likewise this tree's vLLM tier bench (scripts/bench_vllm_tier.py
#            -> hicache_mp/bench/vllm/) over the before tree, reaching the
#            engine through hicache_mp.integrations.vllm. Busy mode, warm I/O,
#            4 GiB phases, 5 rounds a run; no fs row (--fs-py-threads 0: the
#            fs rows took 8 of every 9 seconds and are not compared).
# The before tree travels as a tar (made with
# `mkdir -p .before && git archive 05859c4 > .before/before.tar`; .before/ is
# ignored: carry it). Pairs alternate their order (b a, a b, b a, ...).
#
# Dependencies: prefetch needs posix_ipc (the wheel in .whl/); stack sources
# scripts/device/device_deps.sh (.whl/: SGLang stripped and its wheels); vllm
# installs as scripts/device/device_vllm.sh does (every wheel of the directory,
# the stripped vLLM unpacked and marked +cpu) from $HICACHE_MP_VLLM_WHL:
# default .whl-ba (scripts/device/device_before_after_wheels.sh makes it, ~28
# MiB: .whl-vllm less the fs C helper) if there is one, else .whl-vllm
# (device_vllm_wheels.sh); a wheel of .whl/ that directory lacks goes in too
# if the box lacks the package. .whl (52 MB) and .whl-ba together are over
# the 64 MiB a call carries: stack and vllm are two calls (the machine stays
# warm between them). HICACHE_MP_DEVICE_DEPS=system, or the packages
# importing already, skips every install (a CPU machine that has them).
#
# Usage: scripts/device/device_before_after.sh OUTDIR prefetch|stack|vllm [RUNS]
#   RUNS: before/after pairs (default 2).
#   HICACHE_MP_BA_SIZE=box (default: the H200 sizes below) | quick (a CPU smoke run).
#   HICACHE_MP_BA_TIMEOUT: seconds per run (default per benchmark, below).
#   HICACHE_MP_BA_ARGS: extra arguments for every run of the bench.
# Box sizes are meant for: 3 pairs of prefetch in one call (~5 min), 2 pairs
# of stack in another and 2 of vllm in a third (~4.5 min each); each run is cut off by its
# timeout (prefetch 80 s, stack 110 s, vllm 150 s) so a hung one cannot eat the
# call. Each run leaves OUTDIR/<what>-<before|after>-<n>.{json,log}; the table
# goes to OUTDIR/<what>-summary.txt. If OUTDIR is under $OUT (a device call
# brings back at most 8 files) the runs' files are kept in /tmp and come back
# as one OUTDIR/<what>-runs.tar.gz beside the summary.
set -u
usage="usage: scripts/device/device_before_after.sh OUTDIR prefetch|stack|vllm [RUNS]"
dest=${1:?$usage}
what=${2:?$usage}
runs=${3:-2}
case "$what" in prefetch|stack|vllm) ;; *) echo "$usage"; exit 2 ;; esac
size=${HICACHE_MP_BA_SIZE:-box}
extra=${HICACHE_MP_BA_ARGS:-}
mkdir -p "$dest" && dest=$(cd "$dest" && pwd)
cd "$(dirname "$0")/../.."
after=$PWD
out=$dest
if [ -n "${OUT:-}" ] && case "$dest/" in "$(cd "$OUT" && pwd)"/*) true ;; *) false ;; esac; then
  out=/tmp/hicache_mp_ba_runs/$what && rm -rf "$out" && mkdir -p "$out"
fi
t_all=$SECONDS
export PYTHONUNBUFFERED=1

# --- the before tree ---------------------------------------------------------
before=/tmp/hicache_mp_before
test -f .before/before.tar || { echo "no .before/before.tar (git archive 05859c4 > .before/before.tar)"; exit 3; }
rm -rf "$before" && mkdir -p "$before" && tar -xf .before/before.tar -C "$before" || exit 3
case "$what" in
  prefetch)
    cp hicache_mp/bench/loop.py "$before/hicache_mp/bench/" &&
    sed 's/^from hicache_mp\.engine\.config import auto_workers$/from hicache_mp.config import auto_workers/' \
      scripts/bench_prefetch.py > "$before/scripts/bench_prefetch.py" &&
    grep -q '^from hicache_mp.config import auto_workers$' "$before/scripts/bench_prefetch.py" || exit 3 ;;
  stack|vllm)
    for h in loop.py giltrace.py sglang vllm; do
      rm -rf "$before/hicache_mp/bench/$h" && cp -r "hicache_mp/bench/$h" "$before/hicache_mp/bench/" || exit 3
    done
    cp scripts/sglang_stack.py scripts/bench_vllm_tier.py "$before/scripts/" || exit 3 ;;
esac
find "$before" -name __pycache__ -prune -exec rm -rf {} +

# --- dependencies ------------------------------------------------------------
deps=
probe="import posix_ipc"
[ "$what" = stack ] && probe="import posix_ipc; from hicache_mp.bench.sglang import real; real.import_stack()"
[ "$what" = vllm ] && probe="import posix_ipc, vllm.v1.kv_offload.tiering.fs.manager" &&
  export VLLM_TARGET_DEVICE=cpu  # as device_vllm.sh: vLLM's CPU platform, the tier moves no GPU bytes
if [ "${HICACHE_MP_DEVICE_DEPS:-}" = system ] || PYTHONPATH=$after timeout 120 python3 -c "$probe" >/dev/null 2>&1; then
  echo "deps: the system's"
elif [ "$what" = stack ]; then
  . scripts/device/device_deps.sh
elif [ "$what" = prefetch ]; then
  deps=/tmp/hicache_mp_pi
  [ -f "$deps/.installed" ] || { rm -rf "$deps" && python3 -m pip install -q --no-deps --no-index \
    --target "$deps" .whl/posix_ipc*.whl && touch "$deps/.installed"; } || { echo "install failed"; exit 3; }
else  # vllm: as scripts/device/device_vllm.sh
  whl=.whl-vllm; [ -d .whl-ba ] && whl=.whl-ba; whl=${HICACHE_MP_VLLM_WHL:-$whl}
  deps=/tmp/hicache_mp_ba_vllm_deps
  test -f "$whl/vllm-0.33.0-stripped.tar.gz" || { echo "no $whl/vllm-0.33.0-stripped.tar.gz: run scripts/device/device_before_after_wheels.sh and carry .whl-ba"; exit 3; }
  if [ ! -f "$deps/.installed" ]; then
    rm -rf "$deps" && mkdir -p "$deps"
    timeout 120 python3 - "$deps" "$whl" <<'EOF' || { echo "install failed"; exit 3; }
import glob, importlib.metadata as md, os, subprocess, sys
deps, whl = sys.argv[1:]
name = lambda w: os.path.basename(w).split("-")[0].lower()
mine = sorted(glob.glob(f"{whl}/*.whl"))
have = {name(w) for w in mine}
def missing(w):
    try:
        md.version(name(w))
        return False
    except md.PackageNotFoundError:
        return True
# what .whl-vllm would hold (device_vllm_wheels.sh: .ci/vllm-requirements.txt less
# what the box has), taken from .whl/ where that directory lacks it; else only if missing
skip = {"vllm", "torch", "triton", "transformers", "pillow", "tokenizers", "huggingface_hub"}
req = {l.split("=")[0].split("<")[0].split(">")[0].strip().lower().replace("-", "_")
       for l in open(".ci/vllm-requirements.txt") if l.strip() and not l.startswith("#")}
wanted = (req | {"posix_ipc"}) - skip
more = [w for w in sorted(glob.glob(".whl/*.whl"))
        if name(w) not in have and (name(w) in wanted or missing(w))]
if mine or more:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--no-compile", "--target", deps, *mine, *more])
print("installed into", deps, ":", len(mine), "from", whl, "+", [name(w) for w in more], "from .whl")
EOF
    tar -xzf "$whl/vllm-0.33.0-stripped.tar.gz" -C "$deps" || { echo "untar failed"; exit 3; }
    sed -i 's/^Version: 0.33.0$/Version: 0.33.0+cpu/' "$deps/vllm-0.33.0.dist-info/METADATA"
    touch "$deps/.installed"
  fi
fi
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
echo "nproc $(nproc); python $(python3 -c 'import platform; print(platform.python_version())'); size $size; install/setup $((SECONDS - t_all))s"

# --- the runs ------------------------------------------------------------------
if [ "$size" = quick ]; then
  pf=(--quick --file-cap-s 1)
  st=(--round-mib 2 --page-mib 0.125 --layers 2 --heads 4 --head-dim 64 --runs 3 --timeout-s 60)
  vl=(--quick --io warm --modes busy --repeats 2 --fs-py-threads 0)
  tmo=${HICACHE_MP_BA_TIMEOUT:-240}
else
  pf=(--pages 512 --rounds 2 --repeats 3 --file-cap-s 2)
  st=(--round-mib 1024 --page-mib 8 --runs 5 --timeout-s 60)
  # 4 GiB phases (2 GiB ones lasted 60-80 ms, noise-bound), 5 rounds a run, no fs row
  vl=(--rows 2048 --io warm --modes busy --repeats 5 --fs-threads 4 --fs-py-threads 0
      --lookup-keys 200 --phase-timeout-s 20)
fi
case "$what" in
  prefetch) tmo=${tmo:-${HICACHE_MP_BA_TIMEOUT:-80}} ;;
  stack) tmo=${tmo:-${HICACHE_MP_BA_TIMEOUT:-110}} ;;
  vllm) tmo=${tmo:-${HICACHE_MP_BA_TIMEOUT:-150}} ;;
esac
one() {  # tree label n
  local tree=$1 label=$2 n=$3 t0=$SECONDS rc
  local log="$out/$what-$label-$n.log" json="$out/$what-$label-$n.json"
  cd "$tree" || return
  case "$what" in
    prefetch)
      # shellcheck disable=SC2086
      PYTHONPATH=$tree${deps:+:$deps} timeout -k 10 "$tmo" python3 scripts/bench_prefetch.py \
        --workers 0 "${pf[@]}" --storage-dir "/tmp/ba_store_$label" $extra --json "$json" > "$log" 2>&1 ;;
    stack)
      # shellcheck disable=SC2086
      PYTHONPATH=$tree${deps:+:$deps} timeout -k 10 "$tmo" python3 scripts/sglang_stack.py \
        --backends nobytes,mp "${st[@]}" --inject-rounds 0 --no-mixed --no-trace --store /tmp \
        $extra --json "$json" > "$log" 2>&1 ;;
    vllm)
      rm -rf "/tmp/ba_vllm_$label"
      # shellcheck disable=SC2086
      PYTHONPATH=$tree${deps:+:$deps} timeout -k 10 "$tmo" python3 scripts/bench_vllm_tier.py \
        "${vl[@]}" --store "/tmp/ba_vllm_$label" $extra --json "$json" > "$log" 2>&1
      rc=$?; rm -rf "/tmp/ba_vllm_$label"; (exit $rc) ;;
  esac
  rc=$?
  echo "== $what $label #$n rc=$rc in $((SECONDS - t0))s$([ "$rc" = 124 ] && echo " (timed out at ${tmo}s)")"
  [ "$rc" = 0 ] || grep -v "^INFO\|Warning\|warnings.warn\|^{" "$log" | tail -n 8
  cd "$after" || exit 3
  # a call cut off later still brings back the runs so far
  [ "$out" = "$dest" ] || tar -czf "$dest/$what-runs.tar.gz" -C "$out" .
}
# pairs alternate their order (before-after, then after-before, ...): the box
# drifts within a call (the vLLM loop's no-I/O rate fell 11.8 -> 10.2 M/s over
# one), and a fixed order would hand all of that drift to one tree
for n in $(seq 1 "$runs"); do
  if [ $((n % 2)) = 1 ]; then one "$before" before "$n"; one "$after" after "$n"
  else one "$after" after "$n"; one "$before" before "$n"; fi
done
rm -rf /tmp/ba_store_before /tmp/ba_store_after "$before"

python3 scripts/device/before_after_summary.py "$out" "$what" | tee "$dest/$what-summary.txt"
if [ "$out" != "$dest" ]; then
  tar -czf "$dest/$what-runs.tar.gz" -C "$out" . && rm -rf "$out"
fi
echo "total $((SECONDS - t_all))s"
