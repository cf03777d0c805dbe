"""The compiler in the browser: the files the compile page loads to run flowlift's own
compiler under Pyodide (CPython compiled to WebAssembly), all from this machine.

* ``GET /ui/pyodide/{file}`` -- Pyodide's core (from the ``pyodide`` npm package) and the
  wheels the compiler imports (pydantic with pydantic-core's wasm build, jsonschema, ...),
  as ``scripts/fetch_pyodide.sh`` put them in ``.cache/pyodide`` (``FLOWLIFT_PYODIDE_DIR``
  overrides); 404 with the fix when they are missing.
* ``GET /ui/py/flowlift.zip`` -- flowlift's compiler modules (:func:`browser_modules`:
  :mod:`flowlift.browser` and what it imports, found in the installed sources) under a
  ``flowlift/__init__.py`` of their own (the real one imports the SDK, whose HTTP client
  the browser has no use for).

``python -m flowlift.proxy.ui DIR`` writes the same page as a static folder
(``index.html``, ``pyodide/``, ``py/``) that needs no proxy: serve it with
``python -m http.server -d DIR`` (browsers load no WebAssembly module from ``file://``).
"""

from __future__ import annotations

import ast
import functools
import io
import os
import shutil
import zipfile
from importlib import resources
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from flowlift.errors import ConfigError

routes = web.RouteTableDef()

PYODIDE_DIR_ENV: Final = "FLOWLIFT_PYODIDE_DIR"
BUNDLE_NAME: Final = "flowlift.zip"
BROWSER_ENTRY: Final = "browser"
"""The module the page calls (:func:`flowlift.browser.compile_text`); the bundle holds it
and every module of ``flowlift`` it imports (:func:`browser_modules`)."""
BUNDLE_INIT: Final = ('"""flowlift\'s compiler, as the compile page runs it in the browser '
                      '(a subset of flowlift: see flowlift.proxy.ui.offline)."""\n')
BOOT_PY: Final = """
import json, sys
import pyrsistent_as_rpds.pure as _rpds  # jsonschema's rpds, in pure Python
_rpds.is_pure_pyrsistent_as_rpds = True
sys.modules.setdefault("rpds", _rpds)
sys.path.insert(0, "/flowlift_py")
from flowlift.browser import compile_text
def flowlift_compile(text):
    return json.dumps(compile_text(text))
"""
"""Run once in Pyodide after the wheels are loaded and the bundle unpacked (into
``/flowlift_py``); the page then calls ``flowlift_compile(text) -> JSON text``."""
MISSING_HINT: Final = ("the browser compiler's files are not installed: run `bash "
                       "scripts/install.sh --test` (or `bash scripts/fetch_pyodide.sh`), or "
                       f"point {PYODIDE_DIR_ENV} at a folder it filled")


def pyodide_dir() -> Path:
    """Where Pyodide and the wheels are: ``$FLOWLIFT_PYODIDE_DIR``, else the checkout's
    ``.cache/pyodide``."""
    env = os.environ.get(PYODIDE_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".cache" / "pyodide"


def boot_config(root: Path | None = None) -> dict[str, Any] | None:
    """What the page needs to start the compiler (URLs relative to the page), or ``None``
    when the files are not installed (the page then asks the proxy's compiler).

    Returns:
        ``{"pyodide": "pyodide/", "wheels": [file names], "bundle": "py/flowlift.zip",
        "python": BOOT_PY}``.
    """
    root = root or pyodide_dir()
    listing = root / "wheels.txt"
    if not (root / "pyodide.mjs").is_file() or not listing.is_file():
        return None
    wheels = [w for w in listing.read_text("utf-8").split() if w]
    return {"pyodide": "pyodide/", "wheels": wheels, "bundle": f"py/{BUNDLE_NAME}",
            "python": BOOT_PY}


def _flowlift_imports(tree: ast.Module) -> set[str]:
    """The ``flowlift.X`` modules a module's source imports (``if TYPE_CHECKING:`` blocks
    left out: they do not run)."""
    found: set[str] = set()
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "flowlift":
                found.update(f"flowlift.{a.name}" for a in node.names)
            elif node.module.startswith("flowlift."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flowlift."))
        todo.extend(ast.iter_child_nodes(node))
    return found


@functools.cache
def browser_modules() -> tuple[str, ...]:
    """The modules of ``flowlift`` (names under it, e.g. ``compiler``) that
    :data:`BROWSER_ENTRY` imports, directly or not, read from their sources.

    Raises:
        ConfigError: one of them is a package or not a source file of ``flowlift`` (the
            SDK, the proxy: the browser compiler carries plain modules only).
    """
    package = resources.files("flowlift")
    seen: set[str] = set()
    todo = [BROWSER_ENTRY]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        source = package.joinpath(f"{name}.py")
        if "." in name or not source.is_file():
            raise ConfigError(f"the browser compiler cannot carry flowlift.{name} (imported "
                              f"by flowlift.{BROWSER_ENTRY}'s modules): only plain modules "
                              "of flowlift, not its packages", param="flowlift.browser")
        seen.add(name)
        imports = _flowlift_imports(ast.parse(source.read_text("utf-8")))
        todo.extend(m.removeprefix("flowlift.") for m in imports)
    return tuple(sorted(seen))


@functools.cache
def python_bundle() -> bytes:
    """The zip of :func:`browser_modules` (``flowlift/NAME.py``) and their ``__init__``."""
    package = resources.files("flowlift")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("flowlift/__init__.py", BUNDLE_INIT)
        for name in browser_modules():
            zf.writestr(f"flowlift/{name}.py", package.joinpath(f"{name}.py").read_text("utf-8"))
    return buf.getvalue()


def _not_installed(what: str) -> web.Response:
    return web.json_response({"error": {"message": f"{what}: {MISSING_HINT}",
                                        "type": "invalid_request_error", "param": None,
                                        "code": "not_found"}}, status=404)


@routes.get("/ui/pyodide/{name:.+}")
async def pyodide_file(request: web.Request) -> web.StreamResponse:
    root = pyodide_dir().resolve()
    name = request.match_info["name"]
    path = (root / name).resolve()
    if not path.is_relative_to(root) or name.startswith(".") or not path.is_file():
        return _not_installed(f"no file {name!r} in {root}")
    return web.FileResponse(path, headers={"Cache-Control": "max-age=86400",
                                           "X-Content-Type-Options": "nosniff"})


@routes.get(f"/ui/py/{BUNDLE_NAME}")
async def bundle_file(request: web.Request) -> web.Response:
    return web.Response(body=python_bundle(), content_type="application/zip",
                        headers={"Cache-Control": "no-store"})


def build_static(dest: Path, page_files: dict[str, str], root: Path | None = None) -> Path:
    """Write the compile page as a static folder: ``page_files`` (``index.html`` and the
    CSS/JS it links, by name), ``pyodide/`` (a copy of the installed files) and
    ``py/flowlift.zip``; returns the path of ``index.html``.

    Raises:
        ConfigError: when the browser compiler's files are not installed.
    """
    root = root or pyodide_dir()
    if boot_config(root) is None:
        raise ConfigError(f"no Pyodide in {root}: {MISSING_HINT}", param=PYODIDE_DIR_ENV)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(root, dest / "pyodide", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".*"))
    (dest / "py").mkdir(exist_ok=True)
    (dest / "py" / BUNDLE_NAME).write_bytes(python_bundle())
    for name, text in page_files.items():
        (dest / name).write_text(text, "utf-8")
    return dest / "index.html"


def setup(app: web.Application) -> None:
    """Add the routes to the proxy's app."""
    app.add_routes(routes)
