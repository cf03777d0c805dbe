#!/usr/bin/env bash
# README command 1: install, start the proxy with the embedded engine, run the example
# pipeline over real text, print results and the per-stage time split, write the trace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# the model cache (default: the user's ~/.cache/flowlift) stays in the checkout here
export FLOWLIFT_CACHE_DIR="${FLOWLIFT_CACHE_DIR:-$PWD/.cache/flowlift}"
exec .venv/bin/flowlift run --config examples/stdlib_docs/flowlift.toml \
    examples/stdlib_docs/pipeline.py "$@"
