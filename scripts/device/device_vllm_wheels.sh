#!/usr/bin/env bash
# Fetch and build, on a machine with PyPI, what the GPU box (Python 3.12,
# torch+CUDA, transformers 5.17 with its own huggingface_hub < 2, no network)
# lacks to run scripts/bench_vllm_tier.py there (scripts/device/device_vllm.sh):
#  - cp312 manylinux wheels of .ci/vllm-requirements.txt, less vllm and what
#    the box has (torch, triton, transformers, pillow, tokenizers and
#    huggingface_hub: ours is 2.x, which the box's transformers refuses), plus
#    posix_ipc;
#  - vllm-0.33.0-stripped.tar.gz: vLLM's wheel cut down to the files a traced
#    `bench_vllm_tier.py --quick` run loads (hicache_mp.integrations.vllm, the
#    tiering chain, its fs tier, the CPU platform), plus the whole of
#    vllm/platforms and vllm/v1/kv_offload as margin; no .so (they link CUDA
#    and torch 2.14; the run loads none);
#  - fs_io_C.abi3.so: vLLM's fs C helper, built from its sdist by
#    `bench_vllm_tier.py --build-fs-helper`. Its source uses only Python.h, so
#    it is built against no torch at all: the limited API of 3.11, libstdc++
#    and libc alone, and it loads on the box's 3.12 whatever its torch.
# Then it proves the stripped tree is enough: a --quick run from a fresh
# unpack of the tarball (PYTHONPATH as on the box; local python and torch).
# Everything lands in .whl-vllm/ (ignored by git), under 60 MiB; the vLLM
# wheel (336 MB) and sdist (47 MB) are kept in $cache between runs.
# Usage: scripts/device/device_vllm_wheels.sh   (from anywhere; needs pip, g++, and
# this repo's local test environment: torch, numpy, posix_ipc)
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl-vllm
cache=${HICACHE_MP_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hicache_mp}
sdist_sha=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
rm -rf "$dest" && mkdir -p "$dest" "$cache"
plat=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)
cp312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
       --abi cp312 --abi abi3 --abi none "${plat[@]}")
skip='^(vllm|torch|triton|transformers|pillow|tokenizers|huggingface[-_]hub)(==|$)'
pkgs=$( (grep -hvE '^\s*(#|-r|$)' .ci/vllm-requirements.txt; echo posix_ipc) | grep -viE "$skip" | sort -u)
quiet() { grep -v "^WARNING: Location 'file:" || true; }  # this machine's pip.conf noise
# shellcheck disable=SC2086
pip download --quiet "${cp312[@]}" -d "$dest" $pkgs 2>&1 | quiet
pip download --quiet "${cp312[@]}" -d "$cache" vllm==0.33.0 2>&1 | quiet
# pip cannot fetch this sdist without building its metadata (setuptools_rust,
# torch): take it from the same simple index pip reads, checked by its hash.
sdist=$cache/vllm-0.33.0.tar.gz
if ! echo "$sdist_sha  $sdist" | sha256sum -c --status 2>/dev/null; then
  python3 - "$sdist" "$sdist_sha" <<'EOF'
import hashlib, json, sys, urllib.request
out, sha = sys.argv[1], sys.argv[2]
req = urllib.request.Request("https://pypi.org/simple/vllm/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
url = next(f["url"] for f in json.load(urllib.request.urlopen(req, timeout=60))["files"]
           if f["filename"] == "vllm-0.33.0.tar.gz")
data = urllib.request.urlopen(url, timeout=600).read()
assert hashlib.sha256(data).hexdigest() == sha, "vllm-0.33.0.tar.gz: sha256 differs"
open(out, "wb").write(data)
EOF
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m zipfile -e "$cache"/vllm-0.33.0-*.whl "$tmp/full"
find "$tmp/full" -name '*.so' -delete
# The box's marking (device_vllm.sh does the same): vLLM's CPU platform, so
# the trace walks the platform code the box will.
sed -i 's/^Version: 0.33.0$/Version: 0.33.0+cpu/' "$tmp/full/vllm-0.33.0.dist-info/METADATA"
export VLLM_TARGET_DEVICE=cpu PYTHONUNBUFFERED=1

# 1. Build the helper and trace, in one --quick run against the full tree:
# every module loaded from it (sys.modules) and every file opened in it.
echo "== build the fs helper, trace a --quick run over the full vLLM tree"
PYTHONPATH="$tmp/full:$PWD" python3 scripts/device/trace_loaded.py "$tmp/full" "$tmp/files.txt" -- --quick \
  --build-fs-helper "$sdist" --helper-out "$dest/fs_io_C.abi3.so" > "$tmp/trace.log" 2>&1 ||
  { tail -n 40 "$tmp/trace.log"; echo "traced run failed"; exit 1; }
tail -n 2 "$tmp/trace.log"
grep -q "fs C helper: built" "$tmp/trace.log" || { echo "the built helper did not load"; exit 1; }
readelf -d "$dest/fs_io_C.abi3.so" | grep NEEDED | grep -iE 'torch|c10|cuda|nvrtc|python' &&
  { echo "the helper links more than libstdc++/libc"; exit 1; }

# 2. Strip: the traced files, the dist-info, and as margin for paths a --quick
# run on this machine does not take, all of platforms/ and v1/kv_offload/ and
# the pynvml copy vLLM's CUDA probe imports. The tarball keeps vLLM's own
# version line: the box marks it +cpu after unpacking, as here.
sed -i 's/^Version: 0.33.0+cpu$/Version: 0.33.0/' "$tmp/full/vllm-0.33.0.dist-info/METADATA"
( cd "$tmp/full" &&
  { cat "$tmp/files.txt"; find vllm-0.33.0.dist-info vllm/platforms vllm/v1/kv_offload -type f;
    echo vllm/third_party/pynvml.py; } | grep -v __pycache__ | sort -u > "$tmp/keep.txt" &&
  tar -czf - --files-from "$tmp/keep.txt" ) > "$dest/vllm-0.33.0-stripped.tar.gz"
echo "stripped vLLM: $(wc -l < "$tmp/keep.txt") files"

# 3. Prove it: a fresh unpack, marked as on the box, and a --quick run from it
# that must load vLLM from there (a missing module fails the import).
mkdir "$tmp/box"
tar -xzf "$dest/vllm-0.33.0-stripped.tar.gz" -C "$tmp/box"
sed -i 's/^Version: 0.33.0$/Version: 0.33.0+cpu/' "$tmp/box/vllm-0.33.0.dist-info/METADATA"
echo "== --quick run from the stripped tree"
PYTHONPATH="$tmp/box:$PWD" python3 - "$tmp/box" <<'EOF' || { echo "stripped tree: import failed"; exit 1; }
import os, sys
import vllm, vllm.v1.kv_offload.tiering.fs.manager, vllm.v1.kv_offload.tiering.spec  # noqa: F401
import hicache_mp.integrations.vllm  # noqa: F401
from vllm.platforms import current_platform
assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__
print("imports from", os.path.dirname(vllm.__file__), "platform", type(current_platform).__name__)
EOF
PYTHONPATH="$tmp/box:$PWD" python3 scripts/bench_vllm_tier.py --quick \
  --fs-helper "$dest/fs_io_C.abi3.so" > "$tmp/quick.log" 2>&1 ||
  { tail -n 40 "$tmp/quick.log"; echo "stripped tree: --quick failed"; exit 1; }
grep -E "^(tier|hicache_mp|fs |lookup|bytes verified)" "$tmp/quick.log"
grep -q "fs C helper: built" "$tmp/quick.log" || { echo "helper did not load"; exit 1; }

ls "$dest"/*.whl | wc -l | xargs echo "wheels:"
ls -l "$dest" | awk 'NR > 1 {print $5, $9}' | sort -n | tail -n 6
du -sb "$dest" | awk '{printf "%s: %.1f MiB\n", $2, $1 / 1048576}'
test "$(du -sb "$dest" | cut -f1)" -lt $((60 << 20)) || { echo "over 60 MiB"; exit 1; }
