#!/usr/bin/env bash
# Two embedded models in a memory budget that fits one: the default model and a hard-linked
# copy of it under another name. Prints /readyz (what is loaded) around a request to each,
# and how long each request took (the swap included).
#   bash bench/residency_swap.sh [PORT]
set -euo pipefail
cd "$(dirname "$0")/.."
export FLOWLIFT_CACHE_DIR="${FLOWLIFT_CACHE_DIR:-$PWD/.cache/flowlift}"  # the checkout's model cache
port="${1:-8491}"
base="http://127.0.0.1:$port"
twin="$(mktemp -d)/smol-twin"
.venv/bin/python -c "from flowlift.local_engine.models import ensure_default_model as e; e()"
cp -al .cache/flowlift/models/SmolLM2-135M-Instruct "$twin"
.venv/bin/flowlift serve --port "$port" --state-db :memory: --extra-model "$twin" \
  --memory-budget-mb 4000 --log-level warning > bench/results/residency_swap.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; rm -rf "$(dirname "$twin")"' EXIT
for _ in $(seq 1 300); do curl -sf "$base/readyz" >/dev/null && break; sleep 2; done
ask() {
  local t0; t0=$(date +%s.%N)
  curl -sf "$base/v1/chat/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"$1\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"Say hi\"}]}" \
    | cut -c1-160; echo
  echo "request to $1 took $(echo "$(date +%s.%N) - $t0" | bc) s"
  curl -s "$base/readyz"; echo
}
curl -s "$base/readyz"; echo
ask smol-twin
ask SmolLM2-135M-Instruct
