#!/usr/bin/env bash
# 64 concurrent streaming clients (started evenly over the first 30 s) for two minutes against `kvserve up`:
# errors, and the gateway's own share of
# time to first token (its TTFT minus the executor's, from the gateway's histogram). Results: bench/results/soak.*
# usage: [TENANT=1] [TRACE=1] bench/serving/soak.sh [clients] [seconds]
#   TENANT=1: the clients send an API key with rate limits (generous, never reached), so every request also pays
#   for authentication, admission and settling its limits in Redis; results then go to bench/results/soak-tenant.*
#   TRACE=1: gateway and executor export every request's spans over OTLP to a local sink that discards them
#   (bench/serving/otlp_sink.py); results go to bench/results/soak[-tenant]-trace.*
set -euo pipefail
cd "$(dirname "$0")/../.."
CLIENTS=${1:-64}
SECONDS_=${2:-120}
PORT=${PORT:-8330}
OUT=bench/results/soak${TENANT:+-tenant}${TRACE:+-trace}
mkdir -p bench/results
sink=
if [[ -n "${TRACE:-}" ]]; then
  SINK_PORT=${SINK_PORT:-4319}
  nice -n 10 .venv/bin/python -m bench.serving.otlp_sink --port "$SINK_PORT" 2> "$OUT.sink.log" &
  sink=$!
  export OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$SINK_PORT"
fi
.venv/bin/kvserve up --port "$PORT" --max-model-len 2048 --kv-cache-memory 2GiB --log-format text > "$OUT.log" 2>&1 &
up=$!
# each run's stack log is kept under its start time too: the next run overwrites $OUT.log, and a run that went
# wrong (one TRACE=1 run stalled, see bench/RESULTS.md) is only explained by its own log
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
trap 'kill -INT $up 2>/dev/null; wait $up || true; cp "$OUT.log" "$OUT.$STAMP.log"; if [[ -n "$sink" ]]; then kill $sink; wait $sink || true; cat "$OUT.sink.log"; fi' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" | grep -q executor-0; do sleep 1; done
KEY_ARGS=()
if [[ -n "${TENANT:-}" ]]; then
  # the log shows the embedded Redis's URL masked and names a 0600 file holding it whole (its password)
  redis_url=$(cat "$(grep -o 'the whole URL, for `kvserve keys`: [^)]*' "$OUT.log" | head -1 | awk '{print $NF}')")
  key=$(.venv/bin/kvserve keys create --redis-url "$redis_url" --tenant soak --rpm 1000000 --tpm 1000000000 \
    --max-concurrency 1000 2>/dev/null | head -1)
  KEY_ARGS=(--api-key "$key")
fi
# the load client runs below the stack's priority: on a small machine it would otherwise take the cores the
# gateway waits for, and this run measures the gateway, not the client
nice -n "${CLIENT_NICENESS:-10}" .venv/bin/kvserve bench --url "http://127.0.0.1:$PORT" "${KEY_ARGS[@]}" \
  --concurrency "$CLIENTS" --duration "$SECONDS_" \
  --ramp-up "${RAMP_UP:-30}" \
  --prefix-groups 8 --prefix-tokens 128 --question-tokens 32 --tokenizer "$(.venv/bin/kvserve model pull)" \
  --max-tokens 64 --temperature 0.7 --no-progress --output "$OUT.json" | tee "$OUT.txt"
