#!/usr/bin/env bash
# `make demo-multinode`: pdcluster on a real multi-node Ray cluster on this machine (needs root for ip netns).
#
# 1. scripts/multinode.sh up: a head node, a prefill node and two decode nodes, each in its own network namespace
#    with its own IP, plus an external Redis;
# 2. `pdcluster serve --config deploy/cpu-multinode.yaml` on the head node: the pools pinned to their node types,
#    KV crossing nodes (transfer.host: auto);
# 3. a streamed request from outside the cluster, with its timeline (which worker on which node);
# 4. `pdcluster scale`: one more decode worker joins while serving, then the pools shrink back;
# 5. a decode node is lost while 4 streams are in flight: they finish elsewhere, and the router drops the worker;
# 6. everything is stopped (also on Ctrl-C or an error).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MN=scripts/multinode.sh
ROUTER=10.77.0.1:50051
export PDCLUSTER_API_KEYS=${PDCLUSTER_API_KEYS:-demo-$RANDOM$RANDOM}   # the router serves other nodes: keys on
export PDCLUSTER_API_KEY=$PDCLUSTER_API_KEYS                            # what the client commands send
export PDCLUSTER_REDIS_PASSWORD=${PDCLUSTER_REDIS_PASSWORD:-redis-$RANDOM$RANDOM$RANDOM}  # the YAML's redis.password_env
LOG=$(mktemp -d)/serve.log
SERVE_PID=

cleanup() {
  [ -n "$SERVE_PID" ] && kill "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" 2>/dev/null || true
  bash $MN down
  echo "== stopped: namespaces, Ray nodes and Redis are gone (serve log: $LOG)"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

step "starting the Ray cluster: head 10.77.0.1, n1 10.77.0.2 (prefill_node), n2 .3 and n3 .4 (decode_node), Redis .253"
bash $MN up
step "pdcluster serve --config deploy/cpu-multinode.yaml on the head node (loading the model on 3 workers ...)"
bash $MN exec head "$PYTHON" -m pdcluster serve --config deploy/cpu-multinode.yaml >"$LOG" 2>&1 &
SERVE_PID=$!
for _ in $(seq 300); do grep -q "pdcluster ready" "$LOG" && break; kill -0 $SERVE_PID || { cat "$LOG"; exit 1; }; sleep 1; done
grep "pdcluster ready" "$LOG"
"$PYTHON" -m pdcluster status --addr $ROUTER

step "a request from outside the cluster: prefill on n1, KV over the network to a decode node"
"$PYTHON" -m pdcluster generate --addr $ROUTER --stream --max-tokens 40 "The three main reasons the sea is salty are"

step "pdcluster scale --decode 3: a third decode worker registers, warms up and takes requests"
"$PYTHON" -m pdcluster scale --addr $ROUTER --decode 3
"$PYTHON" -m pdcluster status --addr $ROUTER

step "pdcluster scale --decode 2: the least busy decode worker drains and leaves"
"$PYTHON" -m pdcluster scale --addr $ROUTER --decode 2

step "losing node n3 (every process in it is killed) while 4 streams are in flight"
for i in 1 2 3 4; do
  "$PYTHON" -m pdcluster generate --addr $ROUTER --json --max-tokens 64 --ignore-eos \
    "Story $i: the lighthouse keeper climbed the stairs and" >"$LOG.$i" 2>"$LOG.$i.err" &
done
sleep 6
bash $MN kill n3
wait $(jobs -p | grep -v "^$SERVE_PID$") 2>/dev/null || true
for i in 1 2 3 4; do
  "$PYTHON" - "$LOG.$i" "$i" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(f"stream {sys.argv[2]}: {r['usage']['completion_tokens']} tokens, finished on {r['timeline']['decode_worker']}")
EOF
done
grep -E "does not answer|is lost|continuing elsewhere" "$LOG" | sed 's/^.*WARNING router //' | head -8 || true
sleep 15   # Ray declares the lost node's actors dead; the router then forgets the worker and purges its index entries
"$PYTHON" -m pdcluster status --addr $ROUTER
