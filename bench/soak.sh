#!/usr/bin/env bash
# 64 concurrent streaming clients (started evenly over the first 30 s) for two minutes against `kvserve up`:
# errors, and the gateway's own share of
# time to first token (its TTFT minus the executor's, from the gateway's histogram). Results: bench/results/soak.*
# usage: bench/soak.sh [clients] [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
CLIENTS=${1:-64}
SECONDS_=${2:-120}
PORT=${PORT:-8330}
mkdir -p bench/results
.venv/bin/kvserve up --port "$PORT" --max-model-len 2048 --kv-cache-memory 2GiB > bench/results/soak.log 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" | grep -q executor-0; do sleep 1; done
# the load client runs below the stack's priority: on a small machine it would otherwise take the cores the
# gateway waits for, and this run measures the gateway, not the client
nice -n "${CLIENT_NICENESS:-10}" .venv/bin/kvserve bench --url "http://127.0.0.1:$PORT" --concurrency "$CLIENTS" --duration "$SECONDS_" \
  --ramp-up "${RAMP_UP:-30}" \
  --prefix-groups 8 --prefix-tokens 128 --question-tokens 32 --tokenizer "$(.venv/bin/kvserve model pull)" \
  --max-tokens 64 --temperature 0.7 --no-progress --output bench/results/soak.json | tee bench/results/soak.txt
