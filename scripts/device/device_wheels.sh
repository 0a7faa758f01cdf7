#!/usr/bin/env bash
# Fetch, on a machine with PyPI, what the GPU box (Python 3.12, torch+CUDA,
# triton, transformers; no network) lacks to run scripts/sglang_stack.py:
# cp312 manylinux wheels for posix_ipc and the pure-Python/binary packages the
# SGLang storage chain imports (.ci/sglang-requirements.txt and
# .ci/sglang-stack-requirements.txt, less torch/triton/transformers), and
# SGLang 0.5.23 itself. SGLang ships cp311 wheels only; the chain loads none of
# its .so files, so its wheel is unpacked, stripped (no .so, no
# multimodal_gen/test/benchmark) and packed as .whl/sglang-0.5.23-stripped.tar.gz
# (about 11 MB; many small files would cost more to carry unpacked).
# Everything lands in .whl/ (ignored by git), well under the 64 MiB a device
# call carries. scripts/device/device_stack.sh installs from it on the box.
# Usage: scripts/device/device_wheels.sh   (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.whl
mkdir -p "$dest"
skip='^(sglang|torch|triton|transformers)=='
# What pydantic and ipython need at import that this machine had and the GPU box
# lacks (seen there: annotated_types missing stopped the chain).
box_lacks="annotated-types annotated-doc decorator jedi parso prompt_toolkit wcwidth stack_data
executing asttokens pure_eval matplotlib-inline pexpect ptyprocess ipython-pygments-lexers
charset_normalizer markdown-it-py mdurl pyyaml filelock fsspec"
pkgs=$( (grep -hvE '^\s*(#|-r|$)' .ci/sglang-requirements.txt .ci/sglang-stack-requirements.txt; echo posix_ipc; printf '%s\n' $box_lacks) \
        | grep -viE "$skip" | sort -u)
# shellcheck disable=SC2086
pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$dest" $pkgs
tmp=$(mktemp -d)
pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --abi cp311 --platform manylinux_2_34_x86_64 -d "$tmp" sglang==0.5.23
rm -rf "$dest/sglang-0.5.23" "$tmp/x"
python3 -m zipfile -e "$tmp"/sglang-0.5.23-*.whl "$tmp/x"
( cd "$tmp/x" && rm -rf sglang/multimodal_gen sglang/test sglang/benchmark &&
  find . -name '*.so' -delete && find . -name __pycache__ -prune -exec rm -rf {} + )
tar -C "$tmp/x" -czf "$dest/sglang-0.5.23-stripped.tar.gz" .
rm -rf "$tmp"
ls "$dest"/*.whl | wc -l | xargs echo "wheels:"
du -sh "$dest"
