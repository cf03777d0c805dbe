"""The browser compiler without a browser: its entry point gives what
``flowlift compile --local`` prints, its module bundle runs alone (no module of flowlift
outside it), and the proxy serves its files (see test_ui_chromium.py for the page in
Chromium)."""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from browser_graphs import INVALID, VALID, rich_graph

from flowlift import cli
from flowlift.browser import compile_text
from flowlift.errors import ConfigError
from flowlift.proxy.ui import offline
from flowlift.proxy.ui.pages import static_compile_page


def cli_compile(tmp_path, capsys, graph, *flags):
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(graph))
    code = cli.main(["compile", "--local", *flags, str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(autouse=True)
def _no_state_db(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLIFT_CACHE_DIR", str(tmp_path / "cache"))  # nothing learned


@pytest.mark.parametrize("name", sorted(VALID))
def test_the_page_compiles_as_the_cli(name, tmp_path, capsys):
    got = compile_text(json.dumps(VALID[name]))
    code, out, _ = cli_compile(tmp_path, capsys, VALID[name])
    assert code == 0 and got["text"] + "\n" == out
    code, out, _ = cli_compile(tmp_path, capsys, VALID[name], "--json")
    assert json.loads(out) == got["report"]
    recorded = compile_text(json.dumps({"run_id": "wf-1", "graph": VALID[name]}))
    assert recorded == got  # a workflow's recorded graph, pasted as its document


@pytest.mark.parametrize("name", sorted(INVALID))
def test_the_page_reports_problems_as_the_cli(name, tmp_path, capsys):
    got = compile_text(json.dumps(INVALID[name]))
    code, _, err = cli_compile(tmp_path, capsys, INVALID[name])
    assert code == 1 and "report" not in got
    assert err == "".join(f"flowlift compile: {p}\n" for p in got["problems"])


def test_not_json_is_a_problem():
    assert compile_text("{nodes")["problems"][0].startswith("not JSON: ")


def test_the_bundle_runs_alone(tmp_path):
    """The zip the page loads, on a Python without this checkout's flowlift (``-S``: no
    .pth files, so no editable install), compiles as the installed package does."""
    with zipfile.ZipFile(io.BytesIO(offline.python_bundle())) as zf:
        assert sorted(zf.namelist()) == sorted(
            ["flowlift/__init__.py", *(f"flowlift/{m}.py" for m in offline.browser_modules())])
        zf.extractall(tmp_path / "py")
    code = ("import json, sys\nfrom flowlift.browser import compile_text\n"
            "print(json.dumps({'result': compile_text(sys.stdin.read()), 'files': sorted("
            "m.__file__ for n, m in sys.modules.items() if n.startswith('flowlift'))}))")
    others = [p for p in sys.path if p and not (Path(p) / "flowlift").exists()
              and not (Path(p) / "flowlift.py").exists()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "py"), *others])}
    out = subprocess.run([sys.executable, "-S", "-c", code], input=json.dumps(rich_graph()),
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["result"]["text"] == compile_text(json.dumps(rich_graph()))["text"]
    assert all(f.startswith(str(tmp_path / "py")) for f in doc["files"]), doc["files"]


def test_the_bundle_follows_the_imports():
    assert {"browser", "compiler", "graph", "dataflow", "report"} <= set(
        offline.browser_modules())
    tree = ast.parse("from typing import TYPE_CHECKING\nimport flowlift.a\n"
                     "from flowlift import b\nfrom flowlift.c import X\nfrom . import d\n"
                     "def f():\n    from flowlift.e import Y\n"
                     "if TYPE_CHECKING:\n    from flowlift.sdk import Z\nelse:\n"
                     "    import flowlift.g\n")
    assert offline._flowlift_imports(tree) == {f"flowlift.{m}" for m in "abceg"}


def test_a_package_cannot_go_in_the_bundle(monkeypatch):
    monkeypatch.setattr(offline, "BROWSER_ENTRY", "cli")  # imports flowlift.local_engine...
    offline.browser_modules.cache_clear()
    try:
        with pytest.raises(ConfigError, match="only plain modules"):
            offline.browser_modules()
    finally:
        offline.browser_modules.cache_clear()


@pytest.fixture
def fake_pyodide(tmp_path, monkeypatch):
    root = tmp_path / "pyodide"
    (root / "wheels").mkdir(parents=True)
    (root / "pyodide.mjs").write_text("export const loadPyodide = null;")
    (root / "pyodide.asm.wasm").write_bytes(b"\0asm\1\0\0\0")
    (root / "wheels" / "pydantic-2-py3-none-any.whl").write_bytes(b"PK")
    (root / "wheels.txt").write_text("pydantic-2-py3-none-any.whl\n")
    (root / ".stamp").write_text("secret-ish")
    (tmp_path / "outside.txt").write_text("not served")
    monkeypatch.setenv(offline.PYODIDE_DIR_ENV, str(root))
    return root


async def test_the_proxy_serves_pyodide_and_the_bundle(client, fake_pyodide):
    wasm = await client.get("/ui/pyodide/pyodide.asm.wasm")
    assert wasm.status == 200 and wasm.content_type == "application/wasm"
    mjs = await client.get("/ui/pyodide/pyodide.mjs")
    assert mjs.status == 200 and mjs.content_type.endswith("/javascript")
    assert (await client.get("/ui/pyodide/wheels/pydantic-2-py3-none-any.whl")).status == 200
    for bad in ("../outside.txt", "%2e%2e/outside.txt", ".stamp", "nope.js"):
        resp = await client.get(f"/ui/pyodide/{bad}")
        assert resp.status == 404, bad
        assert "not served" not in await resp.text()
    missing = await client.get("/ui/pyodide/nope.js")
    assert "fetch_pyodide.sh" in (await missing.json())["error"]["message"]
    bundle = await client.get("/ui/py/flowlift.zip")
    assert bundle.status == 200
    with zipfile.ZipFile(io.BytesIO(await bundle.read())) as zf:
        assert "flowlift/compiler.py" in zf.namelist()


def boot_of(html: str):
    start = html.index('id="compiler-boot">') + len('id="compiler-boot">')
    return json.loads(html[start:html.index("</script>", start)])


async def test_the_compile_page_boots_the_browser_compiler(client, fake_pyodide):
    resp = await client.get("/ui/compile")
    assert resp.status == 200
    assert "'wasm-unsafe-eval'" in resp.headers["Content-Security-Policy"]
    boot = boot_of(await resp.text())
    assert boot["wheels"] == ["pydantic-2-py3-none-any.whl"]
    assert boot["pyodide"] == "pyodide/" and boot["bundle"] == "py/flowlift.zip"
    assert "compile_text" in boot["python"]


async def test_without_pyodide_the_page_asks_the_proxy(client, tmp_path, monkeypatch):
    monkeypatch.setenv(offline.PYODIDE_DIR_ENV, str(tmp_path / "none"))
    html = await (await client.get("/ui/compile")).text()
    assert boot_of(html) is None and "fetch_pyodide.sh" in html
    assert (await client.get("/ui/pyodide/pyodide.mjs")).status == 404


async def test_the_compile_page_fills_in_a_recorded_graph(client):
    graph = {"name": "recorded", "nodes": [
        {"kind": "input", "id": "doc", "value": "x"},
        {"kind": "llm", "id": "only_step", "messages": [
            {"role": "user", "content": [{"ref": "doc"}]}]}]}
    resp = await client.post("/v1/workflows", json=graph)
    assert resp.status == 200
    run_id = (await resp.text()).split('"run_id": "')[1].split('"')[0]
    timeline = await (await client.get(f"/ui/workflows/{run_id}")).text()
    assert f'href="/ui/compile?run={run_id}"' in timeline
    html = await (await client.get(f"/ui/compile?run={run_id}")).text()
    assert "only_step" in html and "recorded" in html
    missing = await client.get("/ui/compile?run=wf-missing")
    assert missing.status == 404 and "wf-missing" in await missing.text()


def test_the_static_page(tmp_path, fake_pyodide):
    index = offline.build_static(tmp_path / "site", static_compile_page())
    html = index.read_text()
    assert "Content-Security-Policy" in html and "'wasm-unsafe-eval'" in html
    assert boot_of(html)["wheels"] == ["pydantic-2-py3-none-any.whl"]
    site = tmp_path / "site"
    assert (site / "pyodide" / "pyodide.asm.wasm").is_file()
    assert not (site / "pyodide" / ".stamp").exists()
    assert {p.name for p in site.iterdir()} == {"index.html", "ui.css", "report.js",
                                                "compile.js", "pyodide", "py"}
    assert zipfile.is_zipfile(site / "py" / "flowlift.zip")


def test_the_static_page_needs_pyodide(tmp_path, monkeypatch):
    monkeypatch.setenv(offline.PYODIDE_DIR_ENV, str(tmp_path / "none"))
    with pytest.raises(ConfigError, match=r"fetch_pyodide\.sh"):
        offline.build_static(tmp_path / "site", {"index.html": ""})
