# Sourced by scripts/device/device_stack.sh and scripts/device/device_hybrid.sh on the GPU box
# (from the repository root): installs from .whl/ (made by
# scripts/device/device_wheels.sh) only what the box lacks into $deps, unpacks the
# stripped SGLang, and puts both on PYTHONPATH. Exits 3 if the install fails.
deps=${HICACHE_MP_DEVICE_DEPS:-/tmp/hicache_mp_deps}
mkdir -p "$deps"
export PYTHONUNBUFFERED=1
t0=$SECONDS
# Only what the box lacks goes into $deps: its own torch/triton/transformers
# (and anything else it has) stay in charge.
timeout 120 python3 - "$deps" .whl/*.whl <<'EOF' || { echo "install failed"; exit 3; }
import importlib.metadata as md, os, subprocess, sys, tarfile
deps, wheels = sys.argv[1], sys.argv[2:]
need = []
for w in wheels:
    try:
        md.version(os.path.basename(w).split("-")[0])
    except md.PackageNotFoundError:
        need.append(w)
try:
    md.version("sglang")
except md.PackageNotFoundError:
    tarfile.open(".whl/sglang-0.5.23-stripped.tar.gz").extractall(deps)
if need:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--no-index", "--target", deps, *need])
print("installed into", deps, ":", [os.path.basename(w).split("-")[0] for w in need])
EOF
export PYTHONPATH=$PWD:$deps${PYTHONPATH:+:$PYTHONPATH}
echo "install: $((SECONDS - t0))s"
