#!/usr/bin/env bash
# SIGTERM drain on the real engine: start `flowlift serve` (embedded vLLM), open a
# 64-token chat stream, send SIGTERM a second into it, then print what a new request
# and /readyz answer during the drain, the exit code, the time from SIGTERM to exit,
# and whether the stream in flight ended with [DONE]. Figures: bench/RESULTS.md.
#
#   bash bench/drain_real.sh [PORT]
set -u
cd "$(dirname "$0")/.."
export FLOWLIFT_CACHE_DIR="${FLOWLIFT_CACHE_DIR:-$PWD/.cache/flowlift}"  # the checkout's model cache
port="${1:-8793}"
out="$(mktemp -d)"
.venv/bin/flowlift serve --port "$port" --state-db "$out/state.sqlite" --grace-s 20 \
  > "$out/proxy.log" 2>&1 &
pid=$!
t0=$(date +%s)
until curl -sf "localhost:$port/readyz" > /dev/null; do
  sleep 1
  kill -0 "$pid" 2> /dev/null || { echo "the proxy exited; see $out/proxy.log"; exit 1; }
done
echo "ready after $(( $(date +%s) - t0 )) s"
curl -sN "localhost:$port/v1/chat/completions" -H 'content-type: application/json' -d \
  '{"model":"SmolLM2-135M-Instruct","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"Write a long story about a cat."}]}' \
  > "$out/stream.txt" &
stream=$!
sleep 1
ts=$(date +%s.%N)
kill -TERM "$pid"
sleep 0.3
curl -s -o /dev/null -w "new request during the drain: HTTP %{http_code}\n" \
  "localhost:$port/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"hi"}]}'
curl -s -o /dev/null -w "/readyz during the drain: HTTP %{http_code}\n" "localhost:$port/readyz"
wait "$pid"
rc=$?
te=$(date +%s.%N)
wait "$stream"
echo "exit code $rc, $(python3 -c "print(round($te - $ts, 1))") s after SIGTERM"
echo "stream in flight: $(grep -c '^data: {' "$out/stream.txt") chunks, ends with [DONE]: $(grep -q '^data: \[DONE\]' "$out/stream.txt" && echo yes || echo no)"
grep -E '"event": "drain_done"' "$out/proxy.log"
