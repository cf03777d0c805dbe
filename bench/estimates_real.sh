#!/usr/bin/env bash
# issue 15 item 6 on the real engine: the example pipeline twice through one proxy; planned vs measured critical path
set -uo pipefail
cd "$(dirname "$0")/.."
export FLOWLIFT_CACHE_DIR=$PWD/.cache/flowlift
rm -f ${TMPDIR:-/tmp}/flowlift-est-state.sqlite*
nice -n 19 .venv/bin/python -m flowlift serve --config examples/stdlib_docs/flowlift.toml --port 8481 --state-db ${TMPDIR:-/tmp}/flowlift-est-state.sqlite --log-level warning > ${TMPDIR:-/tmp}/flowlift-est-serve.log 2>&1 &
pid=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8481/readyz >/dev/null && break; sleep 2; done
ids=()
for k in 1 2; do
  out=$(FLOWLIFT_BASE_URL=http://127.0.0.1:8481 nice -n 19 .venv/bin/python -m examples.stdlib_docs.pipeline 2>&1 | tee ${TMPDIR:-/tmp}/flowlift-est-run$k.log | grep -o "run id: wf-[0-9a-f]*" | head -1 | cut -d' ' -f3)
  ids+=("$out")
done
nice -n 19 .venv/bin/python bench/estimate_check.py http://127.0.0.1:8481 "${ids[@]}"
kill $pid; wait $pid 2>/dev/null
