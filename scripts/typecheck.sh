#!/usr/bin/env bash
# The typing gate: mypy --strict (settings in pyproject.toml [tool.mypy]) over the whole
# package `flowlift`. Exits non-zero, after printing mypy's errors, on any error.
#
#   bash scripts/typecheck.sh            # extra arguments go to mypy
#
# The package's parts live in src/flowlift, sdk/, proxy/, local_engine/ and tracing/ and
# are mapped into `flowlift.*` by pyproject's package-dir; mypy reads them through
# .typecheck/flowlift, a folder of links laid out here the same way, so that it sees the
# real module names (flowlift.proxy.dispatch...). Environment: FLOWLIFT_VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

shadow=.typecheck/flowlift
rm -rf "$shadow"
mkdir -p "$shadow"
for f in src/flowlift/*; do
  ln -s "../../$f" "$shadow/$(basename "$f")"
done
for part in sdk proxy local_engine tracing; do
  ln -s "../../$part" "$shadow/$part"
done

# mypy names files by the links it read; its messages name the files in the tree instead
"${FLOWLIFT_VENV:-.venv}/bin/python" -m mypy "$@" 2>&1 | sed -E \
  -e 's#^\.typecheck/flowlift/(sdk|proxy|local_engine|tracing)/#\1/#' \
  -e 's#^\.typecheck/flowlift/#src/flowlift/#'
