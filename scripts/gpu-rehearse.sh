#!/usr/bin/env bash
# scripts/gpu-rehearse.sh [OUTDIR]: rehearse scripts/gpu-check.sh on a machine without a GPU, before a GPU is lent.
#
# Builds (once) a virtual environment with what a lent GPU machine has (torch, triton, transformers, numpy,
# tokenizers, safetensors, jinja2, tqdm, pyyaml, requests, grpcio, protobuf, pytest; no ray, pydantic or redis: pip
# pulls pydantic in for typer, so it is removed again), copies the tree as the device tool carries it (tracked and
# untracked-not-ignored files) with .whl/ fetched for this python, and runs gpu-check.sh there. On a CPU the steps
# that need CUDA fail on that alone ("needs a CUDA GPU", "cuda_available": false); anything else they print (an
# ImportError, a missing file, a collection error) would have failed on the GPU too. The gpu tests that run without
# CUDA (the Triton kernels, interpreted) run here. tests/test_gpu_check.py checks the imports in the normal suite.
#   GPU_VENV  the environment (default /tmp/gpu-rehearse-venv; kept between runs)
#   TORCH     the torch requirement (default torch==2.13.0, this project's pinned CPU build)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/gpu-rehearse-out}
VENV=${GPU_VENV:-/tmp/gpu-rehearse-venv}
TREE=$(mktemp -d /tmp/gpu-rehearse-tree.XXXXXX)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "${TORCH:-torch==2.13.0}" triton==3.9.0 transformers==5.17.0 numpy tokenizers \
    safetensors jinja2 tqdm pyyaml requests grpcio protobuf pytest
  "$VENV/bin/pip" uninstall -q -y pydantic pydantic_core || true
fi
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$TREE"
PYVER=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
PYVER=$PYVER DEST="$TREE/.whl" bash scripts/gpu-wheels.sh
rm -rf "$OUT" && mkdir -p "$OUT"
echo "tree $TREE ($(du -sh "$TREE" | cut -f1) with .whl; the device tool carries at most 64 MiB)"
env -u PDCLUSTER_KERNEL_DIR PYTHON="$VENV/bin/python" PDCLUSTER_GPU_SITE="$TREE/.site" \
  bash "$TREE/scripts/gpu-check.sh" "$OUT" || true
echo "--- rehearsal: lines that would also fail on a GPU (anything but the missing CUDA) ---"
grep -hE "Error|error:|No module|not found|ERROR" "$OUT"/*.log | grep -vE "needs a CUDA GPU|Torch not compiled with CUDA" \
  | grep -vE "^tests/.*(PASSED|SKIPPED)" | sort -u | head -40 || true
rm -rf "$TREE"
