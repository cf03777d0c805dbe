#!/usr/bin/env bash
# The benchmark's own environment for bench/proxy_overhead.py: LiteLLM's proxy (the peer it
# is compared with) and py-spy (for --profile py-spy) in bench/.venv-litellm (git-ignored),
# never in the project's .venv. About 760 MB; a few minutes on 2 cores.
#
#   bash bench/setup_litellm.sh                       # idempotent
#   LITELLM_SPEC='litellm[proxy]==1.108.7' bash bench/setup_litellm.sh
#   PY=python3.11 bash bench/setup_litellm.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-litellm"
py="${PY:-python3}"
spec="${LITELLM_SPEC:-litellm[proxy]}"
if [ -x "$venv/bin/litellm" ] && [ -x "$venv/bin/py-spy" ] \
   && "$venv/bin/python" -c "import litellm.proxy.proxy_server" 2>/dev/null; then
  echo "already installed in $venv: litellm $("$venv/bin/pip" show litellm 2>/dev/null | sed -n 's/^Version: //p')"
  exit 0
fi
[ -d "$venv" ] || "$py" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "$spec" py-spy
echo "installed litellm $("$venv/bin/pip" show litellm | sed -n 's/^Version: //p') and py-spy into $venv"
