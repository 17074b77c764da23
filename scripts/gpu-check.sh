#!/usr/bin/env bash
# scripts/gpu-check.sh OUTDIR: check a GPU node in one command (issue 26). About 6 minutes on an H100.
#
# Needs python3 with a CUDA torch, triton and transformers (a GPU image's); what engine/ and kv_transfer/ import
# beyond that comes from the wheels in .whl/ (scripts/gpu-wheels.sh fetches them where a registry is reachable).
# Steps, each with its own time limit; a failing or timed-out step does not stop the next, and every step's figures
# are kept as they come:
#   1. setup        install .whl/*.whl into a private folder; record the GPU, torch, triton, transformers
#   2. correctness  python -m pdcluster.bench.engine_gpu: fp32 greedy CUDA == CPU, bf16 ours vs transformers
#   3. gpu tests    pytest -m gpu over the test files that hold gpu tests (the two checks above deselected)
#   4. bench        pdcluster bench engine --device cuda on random:llama-3.1-8b (decode b1/b64 at 512, prefill 2048)
# OUTDIR gets: summary.json (each step's status, seconds and figures), gpu-check.log (everything printed),
# correctness.json, pytest.xml, bench_engine_device.json. Exit status 0 only when every step passed.
set -uo pipefail
OUTDIR=${1:?usage: scripts/gpu-check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
exec > >(tee -a "$OUTDIR/gpu-check.log") 2>&1
PY=${PYTHON:-python3}
SITE=${PDCLUSTER_GPU_SITE:-/tmp/pdcluster-site}
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1 PDCLUSTER_CACHE_DIR=${PDCLUSTER_CACHE_DIR:-/tmp/pdcluster-cache}
STATUS="$OUTDIR/.steps"
: > "$STATUS"

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, record "name rc seconds"
  local name=$1 limit=$2; shift 2
  echo "=== [$name] $(date -u +%H:%M:%S) (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "$name $rc $((SECONDS - t0))" >> "$STATUS"
  echo "=== [$name] rc=$rc in $((SECONDS - t0))s"
  summarize
}

summarize() {
  "$PY" - "$OUTDIR" <<'PY'
import json, os, sys
out = sys.argv[1]
steps = {}
for line in open(os.path.join(out, ".steps")):
    name, rc, secs = line.split()
    steps[name] = {"rc": int(rc), "passed": rc == "0", "timed_out": rc in ("124", "137"), "seconds": int(secs)}
figures = {}
for key, name in (("setup", "env.json"), ("correctness", "correctness.json"), ("bench", "bench_engine_device.json")):
    try:
        with open(os.path.join(out, name)) as f:
            figures[key] = json.load(f)
    except (OSError, ValueError):
        pass
xml = os.path.join(out, "pytest.xml")
if os.path.exists(xml):
    import xml.etree.ElementTree as ET
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    figures["gpu_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    figures["gpu_tests"]["failed"] = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
                                      if c.find("failure") is not None or c.find("error") is not None]
summary = {"steps": steps, "passed": bool(steps) and all(s["passed"] for s in steps.values()), **figures}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
PY
}

setup() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || return 1
  fi
  if [ -f .whl/smollm2-tokenizer.json ]; then
    mkdir -p "$PDCLUSTER_CACHE_DIR/tokenizers" && cp .whl/smollm2-tokenizer.json "$PDCLUSTER_CACHE_DIR/tokenizers/smollm2.json"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" - "$OUTDIR/env.json" <<'PY'
import json, sys, importlib
import torch
env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
       "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
for mod in ("triton", "transformers", "gguf", "crc32c"):
    try:
        env[mod] = getattr(importlib.import_module(mod), "__version__", "present")
    except Exception as e:  # noqa: BLE001
        env[mod] = f"missing: {type(e).__name__}: {e}"
from kv_transfer.transports import nixl_agent  # NOTE: the cu13 wheel's module is nixl_cu13; load() tries each name
env["nixl"] = nixl_agent.unavailable() or "present"
import engine, kv_transfer  # noqa: F401  (what the checks import: fails here rather than in every step)
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env))
PY
}

export PY SITE OUTDIR
export -f setup
step setup 30 bash -c setup  # NOTE: timeout runs programs, not shell functions
step correctness 90 "$PY" -m pdcluster.bench.engine_gpu --device cuda --out "$OUTDIR/correctness.json"
GPU_TESTS=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
# NOTE: the two correctness tests repeat step 2 (its JSON has the figures); the files without gpu tests are not
# collected at all (they import ray, pydantic or redis, which the GPU image lacks).
step gpu_tests 130 "$PY" -m pytest -q -m gpu -p no:cacheprovider --timeout 90 -o addopts="" --junitxml "$OUTDIR/pytest.xml" \
  -k "not equals_the_cpu and not matches_transformers" $GPU_TESTS
step bench 110 "$PY" -m pdcluster.bench.engine_device --model random:llama-3.1-8b --device cuda --repeats 1 \
  --out "$OUTDIR/bench_engine_device.json"
"$PY" -c "import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps(s, indent=1)); sys.exit(0 if s['passed'] else 1)" \
  "$OUTDIR/summary.json"
