#!/usr/bin/env bash
# Routing policies side by side: for each policy, `kvserve up` with 2 executors whose KV pools (200 MiB: 4,551
# tokens) hold four of the eight 1,024-token prefix groups each, with room for the requests in flight: together
# they hold all eight only if each group stays on one executor. Then the same load for each policy.
# Results: bench/results/routing-POLICY.json.
# usage: [KV_CACHE_MEMORY=200MiB] bench/serving/routing.sh [requests] [concurrency]
set -euo pipefail
cd "$(dirname "$0")/../.."
REQUESTS=${1:-48}
CONCURRENCY=${2:-4}
PORT=${PORT:-8310}
mkdir -p bench/results
for policy in ${POLICIES:-cache_aware round_robin random}; do
  .venv/bin/kvserve up --port "$PORT" --executors 2 --kv-cache-memory "${KV_CACHE_MEMORY:-200MiB}" --max-model-len 2048 \
    --routing-policy "$policy" > "bench/results/routing-$policy.log" 2>&1 &
  up=$!
  until curl -sf "http://127.0.0.1:$PORT/health" | grep -q executor-1; do sleep 1; done
  nice -n 19 .venv/bin/kvserve bench --url "http://127.0.0.1:$PORT" --endpoint completions --prefix-groups 8 \
    --prefix-tokens 1024 --question-tokens 32 --tokenizer "$(.venv/bin/kvserve model pull)" \
    --num-requests "$REQUESTS" --concurrency "$CONCURRENCY" --max-tokens 8 --ignore-eos --no-progress \
    --output "bench/results/routing-$policy.json" | tee "bench/results/routing-$policy.txt"
  kill -INT "$up"
  wait "$up" || true
done
