#!/usr/bin/env bash
# The whole test suite (`make test`, and CI through .ci/run) in two lanes at once:
#   - the tests marked `slow` (Ray clusters, `pdcluster serve` processes, the fault tests, transformers' reference),
#     at the machine's normal priority: their timing is what the fault tests judge;
#   - the others (unit tests: no cluster, no worker process), at nice 19, on the CPU the first lane leaves idle while
#     it waits for restarts, deadlines and hang detection (a third of it on 2 cores).
# Serially (`python -m pytest -q`) the same tests take ~24-27 min on 2 cores; in lanes ~19. Extra arguments go to
# both lanes' pytest. Exit status: nonzero when either lane fails; the unit lane's report comes after the slow one's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
unit_log=$(mktemp "${TMPDIR:-/tmp}/pdcluster-unit-tests.XXXXXX")
start=$(date +%s)

# NOTE: no cache plugin in the unit lane: two pytest processes would write .pytest_cache at once
nice -n 19 "$PY" -m pytest -q -m "not slow" -p no:cacheprovider "$@" > "$unit_log" 2>&1 &
unit=$!
trap 'kill "$unit" 2>/dev/null; rm -f "$unit_log"' EXIT

echo "== tests marked slow (the unit tests run beside them at nice 19; their report follows) =="
"$PY" -m pytest -q -m slow "$@"
slow_rc=$?
wait "$unit"
unit_rc=$?
echo
echo "== unit tests (not marked slow) =="
cat "$unit_log"
echo
echo "slow lane: exit ${slow_rc}; unit lane: exit ${unit_rc}; $(( $(date +%s) - start )) s in all"
# NOTE: 5 is pytest's "no tests collected" (arguments that select tests of one lane only): not a failure
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }
ok "$slow_rc" && ok "$unit_rc" && ! { [ "$slow_rc" -eq 5 ] && [ "$unit_rc" -eq 5 ]; }
