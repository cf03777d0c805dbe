#!/usr/bin/env bash
# The browser compiler's files (the compile page runs flowlift's compiler in the browser,
# see proxy/ui/offline.py): Pyodide from the npm registry and the wheels the compiler
# imports (pydantic, pydantic-core's Pyodide build, jsonschema and its pure-Python
# dependencies) from PyPI, into .cache/pyodide (ignored by git). Idempotent: nothing is
# fetched when the stamp names the same versions.
#
#   bash scripts/fetch_pyodide.sh [PYTHON]   # PYTHON: the venv's python (its pydantic
#                                            # and jsonschema versions are the ones fetched)
#
# The npm package holds Pyodide's core only (pyodide.mjs, pyodide.asm.{mjs,wasm},
# python_stdlib.zip, pyodide-lock.json) and none of its package wheels; pydantic-core
# publishes a wasm wheel (platform pyemscripten_2026_0_wasm32) on PyPI, rpds-py does not,
# so jsonschema's `rpds` comes from pyrsistent-as-rpds-py (pure Python, on pyrsistent).
set -euo pipefail
cd "$(dirname "$0")/.."

PYODIDE_VERSION=314.0.8
PYODIDE_PLATFORM=pyemscripten_2026_0_wasm32  # pyodide-lock.json's info.abi_version 2026_0
PY="${1:-.venv/bin/python}"
DEST=.cache/pyodide

ver() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
wheels=()
for dist in pydantic pydantic-core typing-extensions typing-inspection annotated-types \
    jsonschema jsonschema-specifications referencing attrs; do
  wheels+=("$dist==$(ver "$dist")")
done
wheels+=("pyrsistent-as-rpds-py==2.1.0" "pyrsistent==0.20.0")
key="pyodide $PYODIDE_VERSION ${wheels[*]}"
if [[ "$(cat "$DEST/.stamp" 2>/dev/null)" == "$key" ]]; then
  echo "flowlift install: browser compiler files up to date ($DEST)"
  exit 0
fi

t0=$(date +%s)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "flowlift install: Pyodide $PYODIDE_VERSION (npm) and ${#wheels[@]} wheels (PyPI) into $DEST"
(cd "$tmp" && npm pack --silent "pyodide@$PYODIDE_VERSION" >/dev/null)
tar -xzf "$tmp/pyodide-$PYODIDE_VERSION.tgz" -C "$tmp"
rm -rf "$DEST"
mkdir -p "$DEST/wheels"
for f in pyodide.mjs pyodide.asm.mjs pyodide.asm.wasm python_stdlib.zip pyodide-lock.json \
    package.json; do
  cp "$tmp/package/$f" "$DEST/"
done
if ! "$PY" -m pip --disable-pip-version-check -qq download --no-deps --only-binary=:all: \
    --platform "$PYODIDE_PLATFORM" --python-version 3.14 --implementation cp --abi cp314 \
    -d "$DEST/wheels" "${wheels[@]}"; then
  echo "flowlift install: a wheel for Pyodide ($PYODIDE_PLATFORM) is missing on PyPI for" \
    "one of: ${wheels[*]} (pydantic-core publishes one per release: pin the venv's" \
    "pydantic to a release that has it, or move PYODIDE_VERSION to the Pyodide of that" \
    "platform)" >&2
  exit 1
fi
(cd "$DEST/wheels" && ls -1 ./*.whl | sed 's|^\./||' > ../wheels.txt)
echo "$key" > "$DEST/.stamp"
echo "flowlift install: browser compiler files ($(du -sh "$DEST" | cut -f1)) in $(( $(date +%s) - t0 )) s"
