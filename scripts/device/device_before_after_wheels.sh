#!/usr/bin/env bash
# Make .whl-ba/ (ignored by git, ~28 MiB): what `device_before_after.sh OUTDIR
# vllm` installs on the GPU box, on its own (carry it with .before; .whl is
# SGLang's and is not needed then). It is scripts/device/device_vllm_wheels.sh's
# .whl-vllm less vLLM's fs C helper (the before/after runs compare this
# engine's tier only, the fs rows run on vLLM's Python fallback) and without
# downloading vLLM's wheel and sdist:
#  - cp312 wheels of .ci/vllm-requirements.txt less vllm and what the box has
#    (torch, triton, transformers, pillow, tokenizers, huggingface_hub), plus
#    posix_ipc: copied from .whl/ where it has them, else fetched with pip;
#  - vllm-0.33.0-stripped.tar.gz: the files of this machine's installed vLLM
#    0.33.0 (pip install --no-deps -r .ci/vllm-requirements.txt) that a traced
#    `bench_vllm_tier.py --quick --io warm --modes busy` run loads, plus all of
#    vllm/platforms and vllm/v1/kv_offload and the pynvml copy, as
#    device_vllm_wheels.sh keeps; no .so; its dist-info says 0.33.0 (the box
#    marks it +cpu after unpacking).
# Then it proves the tarball is enough: a --quick run from a fresh unpack.
# Usage: scripts/device/device_before_after_wheels.sh   (needs pip and the
# local vLLM 0.33.0)
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl-ba
rm -rf "$dest" && mkdir -p "$dest"
export VLLM_TARGET_DEVICE=cpu PYTHONUNBUFFERED=1
site=$(python3 -c 'import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))')
grep -q '^Version: 0.33.0' "$site/vllm-0.33.0.dist-info/METADATA" || { echo "no vLLM 0.33.0 in $site"; exit 1; }
plat=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)
cp312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
       --abi cp312 --abi abi3 --abi none "${plat[@]}")
skip='^(vllm|torch|triton|transformers|pillow|tokenizers|huggingface[-_]hub)(==|$)'
fetch=()
while read -r req; do
  n=$(echo "${req%%=*}" | tr 'A-Z-' 'a-z_')
  w=$(ls .whl/ 2>/dev/null | grep -i "^${n}-" | grep '\.whl$' | head -1 || true)
  if [ -n "$w" ]; then cp ".whl/$w" "$dest/"; else fetch+=("$req"); fi
done < <( (grep -hvE '^\s*(#|-r|$)' .ci/vllm-requirements.txt; echo posix_ipc) | grep -viE "$skip" | sort -u)
[ ${#fetch[@]} = 0 ] || pip download --quiet "${cp312[@]}" -d "$dest" "${fetch[@]}" 2>&1 |
  { grep -v "^WARNING: Location 'file:" || true; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== trace a --quick run over the installed vLLM"
PYTHONPATH=$PWD python3 scripts/device/trace_loaded.py "$site" "$tmp/files.txt" --within vllm -- --quick --io warm,cold \
  --modes idle,busy --store "$tmp/store" > "$tmp/trace.log" 2>&1 ||
  { tail -n 30 "$tmp/trace.log"; echo "traced run failed"; exit 1; }
tail -n 1 "$tmp/trace.log"
( cd "$site" &&
  { cat "$tmp/files.txt"; find vllm-0.33.0.dist-info vllm/platforms vllm/v1/kv_offload -type f;
    echo vllm/third_party/pynvml.py; } | grep -v __pycache__ | grep -v '\.so$' | sort -u > "$tmp/keep.txt" &&
  tar -czf - --files-from "$tmp/keep.txt" ) > "$dest/vllm-0.33.0-stripped.tar.gz"
echo "stripped vLLM: $(wc -l < "$tmp/keep.txt") files"

echo "== --quick run from a fresh unpack of the stripped tree"
mkdir "$tmp/box"
tar -xzf "$dest/vllm-0.33.0-stripped.tar.gz" -C "$tmp/box"
sed -i 's/^Version: 0.33.0$/Version: 0.33.0+cpu/' "$tmp/box/vllm-0.33.0.dist-info/METADATA"
PYTHONPATH="$tmp/box:$PWD" python3 - "$tmp/box" <<'EOF' || { echo "stripped tree: import failed"; exit 1; }
import sys, vllm
assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__
print("vllm from", vllm.__file__)
EOF
PYTHONPATH="$tmp/box:$PWD" python3 scripts/bench_vllm_tier.py --quick --io warm --modes busy \
  --store "$tmp/store2" > "$tmp/quick.log" 2>&1 || { tail -n 30 "$tmp/quick.log"; echo "--quick failed"; exit 1; }
grep -E "^bytes verified" "$tmp/quick.log"
ls "$dest"/*.whl | wc -l | xargs echo "wheels:"
du -sb "$dest" | awk '{printf "%s: %.1f MiB\n", $2, $1 / 1048576}'
