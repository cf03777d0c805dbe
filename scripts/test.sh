#!/usr/bin/env bash
# README command 2: install the test dependencies and run the whole suite, including the
# integration tests on the real vLLM engine (one engine start per session).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
export FLOWLIFT_REQUIRE_ENGINE=1
exec .venv/bin/python -m pytest "$@"
