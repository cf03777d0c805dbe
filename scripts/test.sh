#!/usr/bin/env bash
# README command 2: install the test dependencies, check the types (scripts/typecheck.sh),
# and run the whole suite, including the integration tests on the real vLLM engine (one
# engine start per session).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
bash scripts/typecheck.sh  # the typing gate: any mypy error stops here, before the tests
export FLOWLIFT_REQUIRE_ENGINE=1
# the model cache (default: the user's ~/.cache/flowlift) stays in the checkout here
export FLOWLIFT_CACHE_DIR="${FLOWLIFT_CACHE_DIR:-$PWD/.cache/flowlift}"
export FLOWLIFT_REQUIRE_CHROMIUM=1  # the page tests (tests/proxy/test_ui_chromium.py) must run
export FLOWLIFT_REQUIRE_POSTGRES=1  # the Postgres run store's tests (tests/pg.py) must run
export FLOWLIFT_REQUIRE_ROUTERS=1  # the tests in front of real routers (tests/routers.py) must run
exec .venv/bin/python -m pytest "$@"
