#!/usr/bin/env bash
# Issue 45's figures on the GPU box, in one call: poll() with 24 ops in flight
# (bench_poll --in-flight), bench_prefetch at 256 and 1,024 pages with the
# loop's floor row (plain readers moving the same bytes at mp's rate), and
# the main job (`hicache-mp bench`, full geometry, DeviceLoader on the GPU)
# as none / mp pairs, interleaved, with the TTFT breakdown; then one JSON of
# everything (OUTDIR/issue45.json), every log and JSON in OUTDIR/issue45.tgz
# (remade after each step: a device call returns few files) and the tables
# (summary at the end). The work files go to /tmp/w45.
# Needs posix_ipc: carry .whl-45 (python3 -m pip download --no-deps
# --only-binary=:all: --python-version 3.12 --implementation cp --platform
# manylinux2014_x86_64 -d .whl-45 posix_ipc==1.3.2).
# Usage: scripts/device/device_issue45.sh OUTDIR
# Knobs (a CPU dry run shrinks them): ROUNDS (5), PAGES_SMALL (256),
# PAGES_BIG (1024), PAGES_LIST (both), POLL_ARGS, LC_ARGS ("--num-requests 12"), LC_PAIRS (5),
# BUDGET_S (440: no new step starts after it), HARD_S (470: every step ends
# by then, its timeout cut to fit), QUICK (1: --quick everything),
# STEPS ("poll prefetch lc"; add "pin" for a --pin-workers prefetch run: which to run),
# LC_BACKENDS ("mp": the main job's runs beside none in each pair; mp-direct:G is
# SGLang's direct L3 path with G layer groups, e.g. "mp mp-direct:32").
set -u
final=${1:?usage: scripts/device/device_issue45.sh OUTDIR}
mkdir -p "$final"
final=$(cd "$final" && pwd)
out=/tmp/w45
rm -rf "$out"; mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
if ! python3 -c "import posix_ipc" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site45 \
    .whl-45/*.whl || { echo "install failed"; exit 3; }
  export PYTHONPATH=$PWD:/tmp/site45${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
ROUNDS=${ROUNDS:-5}; PAGES_SMALL=${PAGES_SMALL:-256}; PAGES_BIG=${PAGES_BIG:-1024}
POLL_ARGS=${POLL_ARGS:---workers 14 --page-kib 8192 --pages 512 --rounds 5}
LC_ARGS=${LC_ARGS:---num-requests 12}; LC_PAIRS=${LC_PAIRS:-5}; BUDGET_S=${BUDGET_S:-440}
HARD_S=${HARD_S:-470}
QUICK=${QUICK:-0}
q=""; [ "$QUICK" = 1 ] && q="--quick"
(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1; nproc; date -u
 git log --oneline -1 2>/dev/null) | tee "$out/machine.txt"
step() {  # name limit cmd...: run, log to $out/name.log, say how it went
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  if [ $SECONDS -gt "$BUDGET_S" ]; then echo "== $name skipped: past ${BUDGET_S}s"; return; fi
  [ $((HARD_S - SECONDS)) -lt "$limit" ] && limit=$((HARD_S - SECONDS))
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0))s"
  tar -C "$out" -czf "$final/issue45.tgz" .
}
STEPS=" ${STEPS:-poll prefetch lc} "
want() { [[ $STEPS == *" $1 "* ]]; }
want poll && step poll 60 python3 scripts/bench_poll.py --in-flight 24 $POLL_ARGS --json "$out/poll.json"
want poll && tail -n 6 "$out/poll.log"
for n in $(want prefetch && echo ${PAGES_LIST:-$PAGES_SMALL $PAGES_BIG}); do
  step "prefetch$n" 150 python3 scripts/bench_prefetch.py $q --workers 14 --pages "$n" --rounds 2 \
    --repeats "$ROUNDS" --file-cap-s 1 --storage-dir /tmp/hicache_mp_bp --json "$out/prefetch$n.json"
  grep -A3 "^workers\|^scheduler loop\|^loop beside" "$out/prefetch$n.log" | head -n 8
  grep -E ">= 0\.9|<= 2 " "$out/prefetch$n.log"
done
# "pin" in STEPS: bench_prefetch again at PAGES_BIG with --pin-workers (workers
# kept off the scheduler's core and its siblings), to tell placement from the
# engine's own cost in the loop's ratio to its floor.
if want pin; then
  step "prefetch${PAGES_BIG}pin" 150 python3 scripts/bench_prefetch.py $q --workers 14 --pages "$PAGES_BIG" \
    --rounds 2 --repeats "$ROUNDS" --file-cap-s 1 --pin-workers --storage-dir /tmp/hicache_mp_bp \
    --json "$out/prefetch${PAGES_BIG}pin.json"
  grep -E ">= 0\.9|<= 2 " "$out/prefetch${PAGES_BIG}pin.log"
fi
[ "${KEEP_STORES:-0}" = 1 ] || rm -rf /tmp/hicache_mp_bp
want lc || LC_PAIRS=0
for i in $(seq 1 "$LC_PAIRS"); do
  for spec in none ${LC_BACKENDS:-mp}; do
    b=${spec%%:*}; g=""; name=$b
    [ "$spec" != "$b" ] && g="--layer-groups ${spec#*:}" && name="$b${spec#*:}"
    step "lc_${name}_$i" 120 python3 scripts/bench_long_context.py $q $LC_ARGS $g \
      --hicache-storage-backend "$b" --storage-dir /tmp/hicache_mp_lc --json "$out/lc_${name}_$i.json"
    grep -A2 "^TTFT breakdown" "$out/lc_${name}_$i.log" | tail -n 1
  done
done
python3 - "$out" "$final" <<'EOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
every = {}
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    if os.path.basename(path) == "issue45.json":
        continue
    with open(path) as f:
        every[os.path.basename(path)[:-5]] = json.load(f)
with open(os.path.join(out, "machine.txt")) as f:
    every["machine"] = f.read()
pairs = []   # per round i and backend: (its run, none's run of the same round)
names = sorted({k[3:].rsplit("_", 1)[0] for k in every if k.startswith("lc_")} - {"none"})
for name in names:
    for i in range(1, 100):
        a, b = every.get(f"lc_none_{i}"), every.get(f"lc_{name}_{i}")
        if not (a and b):
            continue
        label = next(iter(b["runs"]))
        tn, tm = a["runs"]["none"]["summary"]["ttft_mean_s"], b["runs"][label]["summary"]["ttft_mean_s"]
        pairs.append({"backend": name, "round": i, "none": tn, "mp": tm, "ratio": tm / tn,
                      "parts_none": a["runs"]["none"]["ttft_parts"]["mean_s"],
                      "parts_mp": b["runs"][label]["ttft_parts"]["mean_s"],
                      "verify_failures": b["runs"][label]["verify"]["failures"]})
every["lc_pairs"] = pairs
with open(os.path.join(sys.argv[2], "issue45.json"), "w") as f:
    json.dump(every, f, indent=1, default=str)
print("\n== summary")
if "poll" in every:
    a = every["poll"]["all"]
    print(f"poll() 24 ops in flight: median {a['median_us']:.2f} us, p99 {a['p99_us']:.2f} us")
for key in sorted(k for k in every if k.startswith("prefetch")):
    r, sw = every[key]["ratios"], every[key]["sweep"]
    head = sw[sorted(sw, key=int)[-1]]
    fl = head["floor"]
    print(f"{key}: mp idle/raw {r['mp_over_raw_ceiling']:.3f} (raw runs {head['raw']['processes_all']}), "
          f"busy/idle {r['mp_busy_over_idle']:.3f} (idle {head['mp_idle']['all_gbps']}, busy "
          f"{head['mp_busy']['all_gbps']}), loop beside mp / floor {r['loop_beside_mp_over_floor']:.3f} "
          f"(rounds {[round(x, 3) for x in fl['loop_over_floor_all']]}), floor/idle "
          f"{r['loop_floor_over_idle']:.3f}, poll median {r['poll_median_us']:.2f} us")
for name in names:
    ps = [p for p in pairs if p["backend"] == name]
    if not ps:
        continue
    rs = [p["ratio"] for p in ps]
    print(f"main job {name}/none mean TTFT: median {statistics.median(rs):.3f} over {len(rs)} pairs "
          f"({', '.join(f'{x:.3f}' for x in rs)}); none {[round(p['none'], 3) for p in ps]}, "
          f"{name} {[round(p['mp'], 3) for p in ps]}; wrong pages "
          f"{sum(len(p['verify_failures']) for p in ps)}")
    for side, label in (("none", "none"), ("mp", name)):
        keys = list(ps[0]["parts_" + side])
        med = {k: statistics.median(p["parts_" + side][k] for p in ps) * 1e3 for k in keys}
        print(f"  {label} parts (median of pairs, ms): " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
EOF
