#!/usr/bin/env bash
# Real Flower deployment on this machine: one SuperLink and N SuperNodes as separate processes on loopback,
# then `flwr run` of a config against them. The multi-machine recipe in deploy/README.md is the same with
# real addresses (and TLS).
#
#   deploy/local_deployment.sh CONFIG NUM_NODES [OUTPUT_DIR] [OVERRIDES]
#
# Each SuperNode gets --node-config "partition-id=<i> num-partitions=<N>" (its client id). Processes are
# stopped (SIGTERM by PID) when the script exits. Exit status: 0 only if the run finished:completed.
set -euo pipefail
CONFIG=$(realpath "$1"); NODES=${2:-2}; OUT=$(realpath -m "${3:-results}"); OVERRIDES=${4:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV_BIN=${VENV_BIN:-$ROOT/.venv/bin}
PORT=${FEDAPPS_SUPERLINK_PORT:-39291}
export PATH="$VENV_BIN:$PATH"
export FLWR_HOME=${FLWR_HOME:-$(mktemp -d /tmp/fedapps-deploy.XXXXXX)}
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
LOGS="$FLWR_HOME/logs"; mkdir -p "$LOGS"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

"$VENV_BIN/python" -c "from fedapps.config import load_config; load_config('$CONFIG', '''$OVERRIDES''')"

flower-superlink --insecure --host 127.0.0.1 --port "$PORT" --disable-runtime-dependency-installation \
  > "$LOGS/superlink.log" 2>&1 &
PIDS+=($!)
for i in $(seq 0 $((NODES - 1))); do
  flower-supernode --insecure --superlink "127.0.0.1:$PORT" --host 127.0.0.1 --port $((PORT + 10 + i)) \
    --node-config "partition-id=$i num-partitions=$NODES" > "$LOGS/supernode-$i.log" 2>&1 &
  PIDS+=($!)
done
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "deploy"

[superlink.deploy]
address = "127.0.0.1:$PORT"
insecure = true
TOML
for _ in $(seq 1 60); do   # wait until every SuperNode is registered
  n=$(flwr supernode ls deploy --format json 2>/dev/null | "$VENV_BIN/python" -c \
      "import json,sys; d=json.load(sys.stdin); print(sum(1 for n in d.get('nodes', []) if str(n.get('status','')).lower().startswith('online')))" 2>/dev/null || echo 0)
  [ "$n" -ge "$NODES" ] && break; sleep 1
done
echo "SuperLink 127.0.0.1:$PORT with $NODES SuperNodes (logs: $LOGS)"
RUNLOG="$LOGS/run.log"
flwr run "$ROOT" deploy --stream \
  --run-config "config='$CONFIG' overrides='$OVERRIDES' output-dir='$OUT'" 2>&1 | tee "$RUNLOG"
RUN_ID=$(grep -oE "Successfully started run [0-9]+" "$RUNLOG" | grep -oE "[0-9]+$" || true)
[ -n "$RUN_ID" ] || { echo "no run id: flwr run did not start" >&2; exit 1; }
STATUS=$(flwr ls deploy --run-id "$RUN_ID" --format json | "$VENV_BIN/python" -c "import json,sys; print(json.load(sys.stdin)['runs'][0]['status'])")
echo "run $RUN_ID: $STATUS"
[ "$STATUS" = "finished:completed" ]
