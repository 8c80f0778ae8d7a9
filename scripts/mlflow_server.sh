#!/usr/bin/env bash
# Start a throwaway MLflow tracking server on 127.0.0.1:5001 (HTTP) for the tracking-server test.
# Prints its URL. Needs the project's .venv (scripts/setup.sh). `mlflow_server.sh stop` stops the server this script
# started (its process group, by the pid it recorded), if it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${MLFLOW_SERVER_DIR:-/tmp/dflash-lab-mlflow-server}
PORT=${MLFLOW_SERVER_PORT:-5001}
URL="http://127.0.0.1:$PORT"
if [ "${1:-}" = stop ]; then
  pid=$(cat "$DIR/server.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -- "-$pid" 2>/dev/null || kill "$pid"
  fi
  rm -f "$DIR/server.pid"
  exit 0
fi
if ! curl -sf "$URL/health" > /dev/null 2>&1; then
  mkdir -p "$DIR"
  # No job runner: MLflow starts seven job consumers (5 s of CPU each at start) that nothing here uses
  # In its own process group (setsid), so that stopping it also stops the workers it forks
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid nohup .venv/bin/mlflow server --host 127.0.0.1 --port "$PORT" \
    --backend-store-uri "sqlite:///$DIR/mlflow.db" --artifacts-destination "$DIR/artifacts" --workers 1 \
    > "$DIR/server.log" 2>&1 &
  echo $! > "$DIR/server.pid"
  for _ in $(seq 1 120); do
    curl -sf "$URL/health" > /dev/null 2>&1 && break
    sleep 0.5
  done
  curl -sf "$URL/health" > /dev/null || { echo "mlflow server did not start; see $DIR/server.log" >&2; exit 1; }
fi
echo "$URL"
