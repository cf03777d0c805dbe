#!/usr/bin/env bash
# Issue 26's figures on the real engine: one proxy with the Qwen2.5-Coder pair
# (examples/stdlib_docs/flowlift.toml), then the demo's pipeline (labels, escalations,
# wall), the agents example on `large` (right answers, valid tool calls) and
# bench/cascade.py --engine pair against the same proxy (cascade vs always-large).
# Needs the pair converted (`flowlift models --prepare --config ...`); run it under the
# shared engine lock:  flock /tmp/flowlift-engine.lock timeout 2400 bash bench/pair_real.sh
# Output: runs/pair/ (proxy log, traces) and bench/results/cascade.pair.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export FLOWLIFT_CACHE_DIR="${FLOWLIFT_CACHE_DIR:-$PWD/.cache/flowlift}"
out=runs/pair
port="${PORT:-8594}"
mkdir -p "$out"
.venv/bin/flowlift serve --port "$port" --config examples/stdlib_docs/flowlift.toml \
  --trace-dir "$out/traces" --state-db "$out/state.sqlite" > "$out/proxy.log" 2>&1 &
proxy=$!
trap 'kill $proxy; wait $proxy' EXIT
t0=$(date +%s)
until curl -sf "http://127.0.0.1:$port/readyz" >/dev/null; do
  sleep 3; kill -0 $proxy || { tail -20 "$out/proxy.log"; exit 1; }
done
echo "engines ready after $(( $(date +%s) - t0 )) s"
export FLOWLIFT_BASE_URL="http://127.0.0.1:$port"
t0=$(date +%s)
.venv/bin/python examples/stdlib_docs/pipeline.py --trace "$out/stdlib.trace.jsonl" --width 160 || true
echo "pipeline: $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
.venv/bin/python examples/agents/research.py --trace-dir "$out"
echo "agents: $(( $(date +%s) - t0 )) s"
.venv/bin/python bench/cascade.py --engine pair --floors "${FLOORS:-0.9}" --base-url "$FLOWLIFT_BASE_URL"
