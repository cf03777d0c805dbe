"""The layers, pinned: every module's imports (at the top, inside functions, under
``TYPE_CHECKING``) are read with :mod:`ast` and checked against the declared order, and
pyproject ships every subpackage (issue 33).

Inside ``proxy/`` a module may import only from a lower rank or its own rank
(:data:`PROXY_RANKS`, bottom first; a module's rank is its longest matching prefix):

====  =====================  =====================================================
rank  name                   what (paths under proxy/)
====  =====================  =====================================================
0     wire                   wire/: the OpenAI wire format, pure code
1     settings               config.py, tenants.py: what every part is set up with
2     store                  store/: the run store and its records
3     request telemetry      telemetry/requests.py: one API request's span, that
                             dispatch writes to
4     dispatch               dispatch/: where a model request goes
5     proxy tools, sessions  tools/, sessions/table.py
6     workflows              workflows/: what runs a workflow
7     run telemetry          telemetry/: run spans, /metrics (over runs, backends)
8     app state              state.py, http.py: what the API routes are handed
9     APIs                   openai/, workflows/api.py, workflows/progress.py,
                             sessions/api.py, ui/
10    app                    app.py, middleware.py, lifecycle.py, half_close.py, the package
====  =====================  =====================================================

Across the roots: the SDK (``flowlift.sdk``) and the engine (``flowlift.local_engine``)
never import the proxy; tracing (``flowlift.tracing``) imports none of the proxy, the
SDK or the engine.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROXY = "flowlift.proxy"
PROXY_RANKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("wire", ("wire",)),
    ("settings", ("config", "tenants")),
    ("store", ("store",)),
    ("request telemetry", ("telemetry.requests",)),
    ("dispatch", ("dispatch",)),
    ("proxy tools, sessions", ("tools", "sessions", "sessions.table")),
    ("workflows", ("workflows",)),
    ("run telemetry", ("telemetry",)),
    ("app state", ("state", "http")),
    ("APIs", ("openai", "workflows.api", "workflows.progress", "sessions.api", "ui")),
    ("app", ("", "app", "middleware", "lifecycle", "half_close")),
)
"""Bottom first: (rank's name, module prefixes relative to :data:`PROXY`; ``""`` is the
package itself)."""

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "flowlift.sdk": (PROXY,),
    "flowlift.local_engine": (PROXY,),
    "flowlift.tracing": (PROXY, "flowlift.sdk", "flowlift.local_engine"),
}
"""root -> what no module under it may import."""


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target, as a module name (``from a import b`` names
    ``a.b`` where ``a.b`` is a module)."""

    source: str
    line: int
    target: str


def _under(name: str, prefix: str) -> bool:
    return not prefix or name == prefix or name.startswith(prefix + ".")


def discover(package_dirs: dict[str, Path]) -> dict[str, Path]:
    """Every module under the mapped roots: dotted name -> file (``__init__.py`` is its
    package). ``package_dirs``: pyproject's ``package-dir`` (package -> folder)."""
    modules: dict[str, Path] = {}
    for package, folder in package_dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            modules.setdefault(name, path)
    return modules


def imports(name: str, path: Path, known: set[str]) -> list[Import]:
    """What module ``name`` (file ``path``) imports, every statement (module level,
    inside functions, under ``TYPE_CHECKING``), relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [Import(name, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(name, node.lineno, sub if sub in known else base))
    return list(dict.fromkeys(found))  # (`from a import b, c`: a once)


def proxy_rank(module: str) -> int | None:
    """The rank (index into :data:`PROXY_RANKS`) of a module of the proxy; None outside."""
    if not _under(module, PROXY):
        return None
    rel = module.removeprefix(PROXY).lstrip(".")
    best, rank = -1, None
    for index, (_, prefixes) in enumerate(PROXY_RANKS):
        for prefix in prefixes:
            if _under(rel, prefix) and len(prefix) > best and (prefix or not rel):
                best, rank = len(prefix), index
    if rank is None:
        raise AssertionError(f"{module} has no rank: add its folder to PROXY_RANKS")
    return rank


def breaks(modules: dict[str, Path]) -> list[str]:
    """Every import against the declared order, as ``source:line imports target (why)``."""
    known = set(modules)
    out = []
    for name, path in sorted(modules.items()):
        for imp in imports(name, path, known):
            for root, banned in FORBIDDEN.items():
                if _under(name, root) and any(_under(imp.target, b) for b in banned):
                    out.append(f"{name}:{imp.line} imports {imp.target} ({root} never "
                               f"imports {', '.join(banned)})")
            source, target = proxy_rank(name), proxy_rank(imp.target)
            if source is not None and target is not None and target > source:
                out.append(f"{name}:{imp.line} imports {imp.target} (rank "
                           f"{PROXY_RANKS[source][0]!r} below {PROXY_RANKS[target][0]!r})")
    return out


def unlisted(modules: dict[str, Path], listed: set[str]) -> list[str]:
    """The packages (folders with an ``__init__.py``) among ``modules`` that pyproject's
    ``packages`` (``listed``) misses, sorted."""
    return sorted(name for name, path in modules.items()
                  if path.name == "__init__.py" and name not in listed)


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _package_dirs() -> dict[str, Path]:
    mapped = _pyproject()["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in mapped.items()}


# -- the tree as it is -------------------------------------------------------------------


def test_no_import_against_the_layers() -> None:
    modules = discover(_package_dirs())
    assert "flowlift.proxy.wire.chunks" in modules  # (the discovery found the proxy)
    assert breaks(modules) == []


def test_every_proxy_module_has_a_rank() -> None:
    for name in discover(_package_dirs()):
        if _under(name, PROXY):
            assert proxy_rank(name) is not None


def test_pyproject_ships_every_subpackage() -> None:
    """Every folder with an ``__init__.py`` under a mapped root is in ``packages``: a
    forgotten subpackage would otherwise install without its modules."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    assert unlisted(discover(_package_dirs()), listed) == []
    found = {name for name, path in discover(_package_dirs()).items()
             if path.name == "__init__.py"}
    assert listed - found == set(), sorted(listed - found)


# -- the checker itself, on planted trees --------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    """Write ``files`` (path -> text) under ``tmp_path``, each folder a package (an empty
    ``__init__.py`` unless given), and discover them."""
    for rel, text in files.items():
        path = tmp_path / rel
        for folder in path.relative_to(tmp_path).parents[:-1]:
            (tmp_path / folder).mkdir(parents=True, exist_ok=True)
            (tmp_path / folder / "__init__.py").touch()
        path.write_text(text, encoding="utf-8")
    return discover({PROXY: tmp_path / "proxy", "flowlift.sdk": tmp_path / "sdk",
                     "flowlift.tracing": tmp_path / "tracing"})


def test_a_planted_upward_import_is_reported(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "proxy/wire/chunks.py": "from flowlift.proxy.dispatch import forward\n",
        "proxy/dispatch/forward.py": "from flowlift.proxy.wire import chunks\n",
    })
    assert breaks(modules) == [
        "flowlift.proxy.wire.chunks:1 imports flowlift.proxy.dispatch.forward "
        "(rank 'wire' below 'dispatch')"]


def test_imports_in_functions_type_checking_and_relative_ones_count(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "proxy/store/sqlite.py": ("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n"
                                  "    from flowlift.proxy.workflows.runs import Run\n"
                                  "def f():\n"
                                  "    from ..openai import routes\n"),
        "proxy/workflows/runs.py": "from . import api\nfrom flowlift.proxy.store import sqlite\n",
        "proxy/workflows/api.py": "",
        "proxy/openai/routes.py": "",
    })
    assert breaks(modules) == [
        "flowlift.proxy.store.sqlite:3 imports flowlift.proxy.workflows.runs "
        "(rank 'store' below 'workflows')",
        "flowlift.proxy.store.sqlite:5 imports flowlift.proxy.openai.routes "
        "(rank 'store' below 'APIs')",
        # workflows (rank 6) importing its own api.py (rank 9) is upward too
        "flowlift.proxy.workflows.runs:1 imports flowlift.proxy.workflows.api "
        "(rank 'workflows' below 'APIs')",
    ]


def test_the_sdk_and_tracing_never_import_the_proxy(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "proxy/state.py": "",
        "sdk/__init__.py": "import flowlift.proxy.state\n",
        "tracing/__init__.py": "def f():\n    from flowlift.sdk import step\n",
    })
    assert breaks(modules) == [
        "flowlift.sdk:1 imports flowlift.proxy.state (flowlift.sdk never imports "
        "flowlift.proxy)",
        "flowlift.tracing:2 imports flowlift.sdk (flowlift.tracing never imports "
        "flowlift.proxy, flowlift.sdk, flowlift.local_engine)",
    ]


def test_a_forgotten_subpackage_is_found(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {"proxy/wire/deep/x.py": ""})
    assert unlisted(modules, {PROXY, "flowlift.proxy.wire"}) == ["flowlift.proxy.wire.deep"]
    assert unlisted(modules, {PROXY, "flowlift.proxy.wire", "flowlift.proxy.wire.deep"}) == []
