#!/usr/bin/env bash
# Second CI environment: the lowest torch that pyproject.toml allows.
#
# The first environment (.ci/run: `pip install -e ".[dev]" && python -m pytest`)
# tests the newest torch that pip resolves. This script tests the other end of
# the supported range: it reads the floor from pyproject.toml ("torch>=X.Y"),
# creates a throw-away virtual environment with torch==X.Y.* and the matching
# torchvision (0.(Y+15).*, which timm needs), installs the project with its dev
# extra and runs the whole suite there. Raising or lowering the floor in
# pyproject.toml is the only edit needed; this script follows it.
#
# PyPI serves CUDA builds of older torch for Linux x86_64 (about 2.6-3.7 GB of
# wheels with the nvidia-* packages); they run on the CPU. Seen on the CI machine
# (2 shared cores): download 1-2 min, install 2.5-8 min, suite 4-17 min depending
# on load; a whole run of this script took 735 s (environment 347 s, suite 380 s).
#
# Environment:
#   TORCH_RANGE_VENV   where to build the venv (default: $TMPDIR/teleopt-torch-floor); removed at the end
#   TORCH_RANGE_KEEP=1 keep the venv afterwards (for local debugging)
#   TORCH_FLOOR=X.Y    test this torch instead of pyproject's floor
set -euo pipefail
cd "$(dirname "$0")/.."

floor="${TORCH_FLOOR:-$(grep -oE '"torch>=[0-9]+\.[0-9]+' pyproject.toml | head -n1 | cut -d= -f2)}"
if [[ ! "$floor" =~ ^2\.[0-9]+$ ]]; then
    echo "torch_range: cannot read a 'torch>=2.Y' floor from pyproject.toml (got '$floor')" >&2
    exit 2
fi
minor="${floor#2.}"
vision="0.$((minor + 15))"   # torch 2.Y pairs with torchvision 0.(Y+15): 2.8/0.23, 2.12/0.27, 2.14/0.29

venv="${TORCH_RANGE_VENV:-${TMPDIR:-/tmp}/teleopt-torch-floor}"
cleanup() { [[ "${TORCH_RANGE_KEEP:-0}" == 1 ]] || rm -rf "$venv"; }
trap cleanup EXIT
rm -rf "$venv"

echo "== torch range: lowest supported torch $floor.* with torchvision $vision.* in $venv"
start=$SECONDS
python -m venv "$venv"
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
# --no-cache-dir: the CUDA wheels would otherwise leave ~3 GB in pip's cache on every machine
python -m pip install -q --no-cache-dir "torch==$floor.*" "torchvision==$vision.*" -e ".[dev]"
python - "$floor" <<'EOF'
import sys

import torch
import torchvision

print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, python {sys.version.split()[0]}")
if not torch.__version__.startswith(sys.argv[1] + "."):
    sys.exit(f"torch_range: expected torch {sys.argv[1]}.*, got {torch.__version__}")
EOF
echo "== torch range: environment ready in $((SECONDS - start)) s"

python -m pytest -q -p no:cacheprovider
echo "== torch range: done in $((SECONDS - start)) s"
