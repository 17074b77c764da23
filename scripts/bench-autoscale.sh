#!/usr/bin/env bash
# `pdcluster bench serve` on the multi-node cluster with a workload that shifts from chat to documents halfway,
# the autoscaler off, then on (deploy/cpu-multinode.yaml, 1 prefill + 1 decode worker at start); SLO attainment per
# minute of both in results/bench_autoscale_on_per_minute.png. Run it under the heavy lock (needs root: ip netns).
#   flock /tmp/pdcluster-heavy.lock bash scripts/bench-autoscale.sh
# Sizing (BENCHMARKS.md, "Autoscaler"): RATE, N (requests per side), the scales and SLOs below.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MN=scripts/multinode.sh
ROUTER=10.77.0.1:50051
RATE=${RATE:-0.6} N=${N:-180} IN=${IN:-0.4} OUT=${OUT:-0.15} TTFT=${TTFT:-5000} ITL=${ITL:-150}
export PDC_MN_NODES="prefill decode" PDC_MN_SLOTS=3   # one node per pool type, room for 3 workers of its type
export PDCLUSTER_API_KEYS=${PDCLUSTER_API_KEYS:-bench-$RANDOM$RANDOM}
export PDCLUSTER_PREFILL__REPLICAS=1 PDCLUSTER_DECODE__REPLICAS=1
export PDCLUSTER_ROUTER__SLO_TTFT_MS=$TTFT PDCLUSTER_ROUTER__SLO_ITL_MS=$ITL
export PDCLUSTER_ROUTER__MAX_PREDICTED_TTFT_MS=120000   # no refusals: the runs compare latency, not load shedding
export PDCLUSTER_AUTOSCALER__MAX_WORKERS=4 PDCLUSTER_AUTOSCALER__INTERVAL_S=10 PDCLUSTER_AUTOSCALER__WINDOW_S=30
export PDCLUSTER_AUTOSCALER__COOLDOWN_S=30 PDCLUSTER_AUTOSCALER__UP_EVALUATIONS=2
mkdir -p results
SERVE_PID=
stop_serve() { [ -n "$SERVE_PID" ] && kill "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null || true; SERVE_PID=; }
trap 'stop_serve; bash $MN down' EXIT

bash $MN up
for side in off on; do
  log=results/bench_autoscale_$side.serve.log
  enabled=false; [ $side = on ] && enabled=true
  PDCLUSTER_AUTOSCALER__ENABLED=$enabled bash $MN exec head "$PYTHON" -m pdcluster serve \
    --config deploy/cpu-multinode.yaml >"$log" 2>&1 &
  SERVE_PID=$!
  for _ in $(seq 300); do grep -q "pdcluster ready" "$log" && break; kill -0 $SERVE_PID || { cat "$log"; exit 1; }; sleep 1; done
  with=(); [ $side = on ] && with=(--plot-with results/bench_autoscale_off.json)
  "$PYTHON" -m pdcluster bench serve --addr $ROUTER --api-key "$PDCLUSTER_API_KEYS" --workload chat_to_documents \
    --rates "$RATE" --num-requests "$N" --input-scale "$IN" --output-scale "$OUT" --slo-ttft-ms "$TTFT" \
    --slo-itl-ms "$ITL" --label "autoscaler $side" --out results/bench_autoscale_$side.json "${with[@]}"
  grep -E "autoscaler: (up|down)|pools scaled|joined the|drained and" "$log" | sed 's/^.*\] //' || true
  stop_serve
done
