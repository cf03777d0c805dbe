#!/usr/bin/env bash
# How long /readyz takes to answer while the real engine loads (the engine loads in a worker
# thread, so the event loop keeps serving), then one chat request and one stream.
#   bash bench/probe_during_load.sh [PORT]
set -euo pipefail
cd "$(dirname "$0")/.."
export FLOWLIFT_CACHE_DIR="${FLOWLIFT_CACHE_DIR:-$PWD/.cache/flowlift}"  # the checkout's model cache
port="${1:-8493}"
.venv/bin/flowlift serve --port "$port" --state-db :memory: --log-level warning \
  > bench/results/probe_during_load.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null' EXIT
max=0; n=0; code=000
for _ in $(seq 1 400); do
  t0=$(date +%s%N)
  code=$(curl -s -o /dev/null -w '%{http_code}' -m 10 "localhost:$port/readyz" || true)
  ms=$(( ($(date +%s%N) - t0) / 1000000 )); n=$((n + 1)); (( ms > max )) && max=$ms
  [[ "$code" == 200 ]] && break
  sleep 0.5
done
echo "readyz probes during the load: $n, slowest answer $max ms, last status $code"
curl -s "localhost:$port/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"default","max_tokens":8,"messages":[{"role":"user","content":"Say hi"}]}' \
  | cut -c1-120; echo
curl -s -N "localhost:$port/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model":"default","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"Say hi"}]}' \
  | tail -2
