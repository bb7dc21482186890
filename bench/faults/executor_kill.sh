#!/usr/bin/env bash
# Issue 13's kill -9 target: `kvserve up --executors 2` (small KV pools, 2 running per executor) under a
# streaming load (`kvserve bench`, 4 prefix groups, so both executors stream) and a non-streaming one
# (bench/faults/executor_kill.py); KILL_AFTER (8) seconds after the streams arrive, once executor-0 runs MIN_RUNNING
# requests, it gets SIGKILL and the load goes on. Reports requests, errors classified (a stream that had tokens
# from the killed executor may end "stopped answering mid-stream"; nothing else may fail), what became of each
# request the killed executor had in flight, and when /health lists it again and it serves again (kvserve up
# restarts it). Exit 0 when the target is met.
# Results: bench/results/executor-kill.{json,txt}, the streaming run in executor-kill-stream.json, the stack's
# log in executor-kill.log.
# usage: [PY=.venv/bin/python] [MODEL=dir] [DURATION=60] [KILL_AFTER=8] [MIN_RUNNING=2] [STREAMS=6] [WHOLE=3]
#        [MAX_TOKENS=32] [KV_CACHE_MEMORY=256MiB] [MAX_NUM_SEQS=2] bench/faults/executor_kill.sh
#   MAX_NUM_SEQS: 2 running per executor, so that 9 clients leave requests queued on the killed executor, not
#   yet started: those must complete elsewhere
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${PORT:-8350}
DURATION=${DURATION:-60}
OUT=bench/results/executor-kill
PY=${PY:-.venv/bin/python}  # python -m: this checkout's code, whichever checkout the venv was installed from
mkdir -p bench/results
rm -f "$OUT-stream.json"
MODEL_ARGS=()
if [[ -n "${MODEL:-}" ]]; then MODEL_ARGS=(--model "$MODEL" --served-model-name bench); fi
"$PY" -m kvserve.cli up --port "$PORT" --executors 2 --kv-cache-memory "${KV_CACHE_MEMORY:-256MiB}" \
  --max-num-seqs "${MAX_NUM_SEQS:-2}" --max-model-len 2048 --log-format text "${MODEL_ARGS[@]}" > "$OUT.log" 2>&1 &
up=$!
streams=
trap 'if [[ -n "$streams" ]]; then kill -INT $streams 2>/dev/null; wait $streams || true; fi; kill -INT $up 2>/dev/null; wait $up || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" | grep -q executor-1; do sleep 1; done
nice -n "${CLIENT_NICENESS:-10}" "$PY" -m kvserve.cli bench --url "http://127.0.0.1:$PORT" --endpoint completions \
  --concurrency "${STREAMS:-6}" --duration "$DURATION" --prefix-groups 4 --prefix-tokens 48 --question-tokens 16 \
  --max-tokens "${MAX_TOKENS:-32}" --ignore-eos --no-progress --output "$OUT-stream.json" > "$OUT-stream.txt" &
streams=$!
status=0
nice -n "${CLIENT_NICENESS:-10}" "$PY" -m bench.faults.executor_kill --url "http://127.0.0.1:$PORT" --up-pid "$up" \
  --streams "${STREAMS:-6}" --kill-after "${KILL_AFTER:-8}" --min-running "${MIN_RUNNING:-2}" --duration "$DURATION" --concurrency "${WHOLE:-3}" --max-tokens "${MAX_TOKENS:-32}" \
  --stream-results "$OUT-stream.json" --gateway-log "$OUT.log" --output "$OUT" || status=$?
wait $streams || true
streams=
cat "$OUT-stream.txt"
exit $status
