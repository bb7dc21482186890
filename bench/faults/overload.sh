#!/usr/bin/env bash
# Issue 13's overload target: REQUESTS (500) streaming requests at once through one gateway, 2 executors with
# 512 MiB KV pools. Reports the load generator's summary (errors must be 0) and, sampled from the executors'
# load in Redis every 100 ms (bench/faults/balance.py), how often an executor sat idle while the other had a queue.
# Results: bench/results/overload.{json,txt,log} and bench/results/overload-balance.json.
# usage: [PY=.venv/bin/python] [MODEL=dir] [MAX_TOKENS=16] [QUEUE_TIMEOUT=600] [KV_CACHE_MEMORY=512MiB] bench/faults/overload.sh [requests]
#   QUEUE_TIMEOUT: how long the gateway may hold a request while both executors' queues are full; on a small
#   CPU machine 500 requests take minutes, and a held request past it gets 503 (that is the deadline working)
set -euo pipefail
cd "$(dirname "$0")/../.."
REQUESTS=${1:-500}
PORT=${PORT:-8340}
OUT=bench/results/overload
PY=${PY:-.venv/bin/python}  # python -m: this checkout's code, whichever checkout the venv was installed from
mkdir -p bench/results
MODEL_ARGS=()
if [[ -n "${MODEL:-}" ]]; then MODEL_ARGS=(--model "$MODEL" --served-model-name bench); fi
"$PY" -m kvserve.cli up --port "$PORT" --executors 2 --kv-cache-memory "${KV_CACHE_MEMORY:-512MiB}" \
  --max-model-len 2048 --queue-timeout "${QUEUE_TIMEOUT:-600}" --log-format text "${MODEL_ARGS[@]}" > "$OUT.log" 2>&1 &
up=$!
sampler=
trap 'if [[ -n "$sampler" ]]; then kill -INT $sampler 2>/dev/null; wait $sampler || true; fi; kill -INT $up 2>/dev/null; wait $up || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" | grep -q executor-1; do sleep 1; done
# the log shows the embedded Redis's URL masked and names a 0600 file holding it whole (its password)
redis_url=$(cat "$(grep -o 'the whole URL, for `kvserve keys`: [^)]*' "$OUT.log" | head -1 | awk '{print $NF}')")
"$PY" -m bench.faults.balance --redis-url "$redis_url" --output "$OUT-balance.json" > /dev/null &
sampler=$!
nice -n "${CLIENT_NICENESS:-10}" "$PY" -m kvserve.cli bench --url "http://127.0.0.1:$PORT" --endpoint completions \
  --request-rate inf --num-requests "$REQUESTS" --prompt "Write a short story about a robot who learns to paint." \
  --max-tokens "${MAX_TOKENS:-16}" --ignore-eos --no-progress --output "$OUT.json" | tee "$OUT.txt"
kill -INT $sampler
wait $sampler || true
sampler=
cat "$OUT-balance.json"
