"""The timeline and compile pages in a real browser: headless Chromium (Debian's
``chromium``, installed by ``scripts/install.sh --test``) against a proxy on a
FakeEngine on a real port, after a small workflow ran to its end. The compile page runs
the compiler in the browser (Pyodide, ``scripts/fetch_pyodide.sh``): those tests drive
the tab over the DevTools protocol (tests/cdp.py) to count every request it makes.

Skipped only when no Chromium is on PATH; ``scripts/test.sh`` (CI) sets
``FLOWLIFT_REQUIRE_CHROMIUM=1`` and then a missing browser is a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import io
import json
import os
import shutil
import subprocess
import threading
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from browser_graphs import INVALID, VALID, rich_graph
from cdp import Tab, chromium_tab

from flowlift import cli, step, tool, workflow
from flowlift.proxy.ui import offline
from flowlift.proxy.ui.pages import static_compile_page
from flowlift.testing import running_proxy

CHROMIUM = next((p for n in ("chromium", "chromium-browser", "google-chrome")
                 if (p := shutil.which(n))), None)
if CHROMIUM is None and os.environ.get("FLOWLIFT_REQUIRE_CHROMIUM") == "1":
    raise RuntimeError("FLOWLIFT_REQUIRE_CHROMIUM=1 but no chromium on PATH: run "
                       "`bash scripts/install.sh --test` (it apt-get installs chromium)")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (`bash scripts/install.sh --test` installs "
    "Debian's chromium package; CI requires it)")

WINDOW = (1500, 1000)
EVIL = '<img src=x onerror="document.title=1">'


@step(max_tokens=12)
def extract(doc):
    return f"Facts of {doc} in a few words"


@tool
def related(facts):
    time.sleep(0.3)
    return [EVIL, "zlib"]


@step(max_tokens=40)
def summarize(facts, rel):
    return f"Summarize {facts} with {rel} into one long sentence for the reader"


@step(max_tokens=2)
def side(x):
    return f"side {x}"


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--no-default-browser-check", "--disable-extensions",
           "--disable-background-networking", "--hide-scrollbars",
           f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


class Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.bars: list[dict[str, str | None]] = []
        self.tags: list[str] = []
        self.report_rows: list[dict[str, str | None]] = []
        self.plan_bars: list[dict[str, str | None]] = []
        self.attrs: dict[str, dict[str, str | None]] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if a.get("id"):
            self.attrs[a["id"]] = a
        if tag == "rect" and "bar" in (a.get("class") or "").split():
            self.bars.append(a)
        if tag == "tr" and a.get("data-step"):
            self.report_rows.append(a)
        if tag == "rect" and "plan-bar" in (a.get("class") or "").split():
            self.plan_bars.append(a)


def dump(url: str, profile: Path) -> Dom:
    out = chromium("--virtual-time-budget=5000", "--dump-dom", url, profile=profile)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = Dom()
    dom.feed(out.stdout)
    return dom


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    log = tmp_path_factory.mktemp("ui") / "proxy.log"
    with running_proxy("--engine", "fake", "--state-db", ":memory:", "--fake-delay-s", "0.02",
                       log_path=log, ready_timeout_s=60) as (base, _):
        yield base


def test_timeline_page_in_chromium(proxy, tmp_path):
    with workflow("chromium check", base_url=proxy) as wf:
        facts = extract("a document")
        summarize(facts, related(facts))
        side("y")
    doc = httpx.get(f"{proxy}/v1/workflows/{wf.run_id}").json()
    assert doc["report"]["critical_path"] == ["extract_1", "related_1", "summarize_1"]
    url = f"{proxy}/ui/workflows/{wf.run_id}"

    shot = tmp_path / "timeline.png"
    out = chromium(f"--screenshot={shot}", url, profile=tmp_path / "profile")
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    assert shot.stat().st_size > 20_000
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == WINDOW
        rgb = img.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20) or []
    count = {c: n for n, c in colours}
    assert len(count) > 50  # text, bars, bands: not a blank or error page
    assert count.get((255, 240, 227), 0) > 10_000  # the critical rows' band (3 rows)
    # each legend swatch is 12 x 12 = 144 px: more than that is bars
    for stage_rgb, least in (((78, 121, 167), 150), ((89, 161, 79), 1000),  # prefill, decode
                             ((176, 122, 161), 1000)):  # tool wait
        assert count.get(stage_rgb, 0) > least, stage_rgb

    dom = dump(url, tmp_path / "profile")
    critical = {b["data-step"] for b in dom.bars if b.get("data-critical") == "measured"}
    assert critical == {"extract_1", "related_1", "summarize_1"}
    assert {b["data-step"] for b in dom.bars} == {"extract_1", "related_1", "summarize_1",
                                                  "side_1"}
    assert {b["data-stage"] for b in dom.bars} >= {"prefill", "decode", "tool_wait"}
    assert "img" not in dom.tags  # the tool's output was markup: shown as text
    rows = {r["data-step"]: r for r in dom.report_rows}  # drawn by report.js
    assert set(rows) == {"extract_1", "related_1", "summarize_1", "side_1"}
    assert {s for s, r in rows.items() if r.get("class") == "critical"} == critical


@step(max_tokens=12)
def extract_the_module_facts(doc):
    return f"Facts of {doc} in a few words"


FITS = """JSON.stringify((() => {
  const page = document.documentElement, W = page.clientWidth, out = [];
  if (page.scrollWidth > W) out.push(`page ${page.scrollWidth} > ${W}`);
  for (const [sel, box] of [['svg.gantt', '.chart'], ['svg.schedule', '.report'],
                            ['table.report-nodes', '.report'], ['.steps table', '.steps']]) {
    const e = document.querySelector(sel), b = document.querySelector(box);
    const r = e.getBoundingClientRect(), br = b.getBoundingClientRect();
    if (r.right > br.right + 1 || r.right > W) out.push(`${sel} ends at ${r.right}`);
    if (b.scrollWidth > b.clientWidth + 1) out.push(`${box} scrolls: ${b.scrollWidth}`);
  }
  return out; })())"""


async def test_plan_chart_and_tables_fit_the_page(proxy, tmp_path):
    """At a narrow, a laptop's and a wide window, nothing on a run's page (the Gantt
    chart, the planned schedule, the plan's table, the steps table) is wider than its
    panel or the page: long step ids wrap, the charts scale down."""
    with workflow("fits the page", base_url=proxy) as wf:
        for k in range(8):
            facts = extract_the_module_facts(f"document number {k}")
            summarize(facts, related(facts))
    async with chromium_tab(CHROMIUM, tmp_path / "profile") as tab:
        for width in (720, 1280, WINDOW[0]):
            await tab.send("Emulation.setDeviceMetricsOverride", width=width, height=900,
                           deviceScaleFactor=1, mobile=False)
            await tab.send("Page.navigate", url=f"{proxy}/ui/workflows/{wf.run_id}")
            await tab.wait_for("!!document.querySelector('table.report-nodes')", 30)
            assert json.loads(await tab.evaluate(FITS)) == [], width
            if width >= 1280:  # room for the chart at its full size
                assert await tab.evaluate(
                    "document.querySelector('svg.gantt').getBoundingClientRect().width") == 840


def cli_compile(graph: dict[str, Any], tmp_path: Path) -> tuple[int, str, str]:
    """``flowlift compile --local GRAPH`` (nothing learned: an empty cache folder)."""
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(graph))
    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("FLOWLIFT_CACHE_DIR")
    os.environ["FLOWLIFT_CACHE_DIR"] = str(tmp_path / "empty-cache")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["compile", "--local", str(path)])
    finally:
        if old is None:
            del os.environ["FLOWLIFT_CACHE_DIR"]
        else:
            os.environ["FLOWLIFT_CACHE_DIR"] = old
    return code, out.getvalue(), err.getvalue()


READY = "document.getElementById('compiler-state').getAttribute('data-ready')"
COMPILED = "document.getElementById('report').getAttribute('data-compiled')"
PAGE_TEXT = ("JSON.stringify({text: document.getElementById('report-text').textContent, "
             "problems: [...document.querySelectorAll('#errors li')].map(li => li.textContent)})")


async def start_compiler(tab: Tab, url: str) -> float:
    """Open the compile page and wait until its compiler ran on the example graph; the
    compiler's start-up time in ms, as the page measured it."""
    if offline.boot_config() is None:
        message = f"no browser compiler in {offline.pyodide_dir()}: {offline.MISSING_HINT}"
        if os.environ.get("FLOWLIFT_REQUIRE_CHROMIUM") == "1":
            raise AssertionError(message)
        pytest.skip(message)
    await tab.send("Page.navigate", url=url)
    assert await tab.wait_for(READY, 180) == "1", tab.console
    assert await tab.wait_for(COMPILED, 30) == "1", await tab.evaluate(PAGE_TEXT)
    return float(await tab.evaluate(
        "document.getElementById('compiler-state').getAttribute('data-load-ms')"))


async def compile_in_page(tab: Tab, graph: dict[str, Any]) -> dict[str, Any]:
    """Paste ``graph`` into the page, press Compile; the text report or the problems."""
    await tab.evaluate(f"document.getElementById('graph').value = {json.dumps(json.dumps(graph))};"
                       "document.querySelector('#compile-form button').click(); 1")
    await tab.wait_for(COMPILED, 30)
    return dict(json.loads(await tab.evaluate(PAGE_TEXT)))


async def check_as_the_cli(tab: Tab, tmp_path: Path) -> None:
    for name, graph in {**VALID, **INVALID}.items():
        got = await compile_in_page(tab, graph)
        code, out, err = cli_compile(graph, tmp_path)
        if name in VALID:
            assert code == 0 and got["problems"] == [] and got["text"] + "\n" == out, name
        else:
            assert code == 1 and got["text"] == "", name
            assert err == "".join(f"flowlift compile: {p}\n" for p in got["problems"]), name


def offsite(requests: list[dict[str, Any]], origin: str) -> list[str]:
    return [u for r in requests if not (u := r["request"]["url"]).startswith(origin + "/")
            and not u.startswith("data:")]


async def test_compile_page_compiles_in_the_browser(proxy, tmp_path):
    """The proxy's compile page: Pyodide and the compiler from the proxy, then every
    graph compiled in the page as `flowlift compile --local` does, with not one request
    after the start (to the proxy or anywhere)."""
    async with chromium_tab(CHROMIUM, tmp_path / "profile") as tab:
        load_ms = await start_compiler(tab, f"{proxy}/ui/compile")
        loaded = len(tab.requests)
        assert offsite(tab.requests, proxy) == []
        assert any(r["request"]["url"].endswith("/ui/pyodide/pyodide.asm.wasm")
                   for r in tab.requests)
        html = await tab.evaluate("document.documentElement.outerHTML")
        dom = Dom()
        dom.feed(html)
        rows = {r["data-step"]: r for r in dom.report_rows}  # the example graph's report
        assert set(rows) == {"doc", "facts", "title", "summary"}
        assert rows["summary"].get("class") == "critical"
        planned = {b["data-step"]: b for b in dom.plan_bars}  # the planned schedule's chart
        assert {s for s, b in planned.items() if b.get("data-critical") == "planned"} == {
            "facts", "summary"}
        await check_as_the_cli(tab, tmp_path)
        assert tab.requests[loaded:] == [], "requests after the compiler started"
    print(f"browser compiler started in {load_ms:.0f} ms")


class LoggedFiles(http.server.SimpleHTTPRequestHandler):
    log: ClassVar[list[str]] = []

    def log_message(self, format: str, *args: Any) -> None:
        LoggedFiles.log.append(self.path)


async def test_static_page_compiles_with_nothing_sent(tmp_path):
    """The static folder (`python -m flowlift.proxy.ui DIR`) under a plain file server
    that logs each request: after the start, neither the server nor the browser sees
    one."""
    if offline.boot_config() is None:
        await start_compiler(None, "")  # type: ignore[arg-type]  # skips or fails
    site = tmp_path / "site"
    offline.build_static(site, static_compile_page())
    handler = functools.partial(LoggedFiles, directory=str(site))
    LoggedFiles.log = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        async with chromium_tab(CHROMIUM, tmp_path / "profile") as tab:
            await start_compiler(tab, f"{origin}/")
            served, loaded = len(LoggedFiles.log), len(tab.requests)
            assert offsite(tab.requests, origin) == []
            assert "/py/flowlift.zip" in LoggedFiles.log
            got = await compile_in_page(tab, rich_graph())
            assert got["text"] + "\n" == cli_compile(rich_graph(), tmp_path)[1]
            await asyncio.sleep(1)  # a request in flight would have reached the server
            assert LoggedFiles.log[served:] == [] and tab.requests[loaded:] == []
    finally:
        server.shutdown()


def test_compile_page_without_pyodide_asks_the_proxy(tmp_path, monkeypatch):
    """No browser compiler installed: the page posts the graph to the proxy's compiler."""
    monkeypatch.setenv(offline.PYODIDE_DIR_ENV, str(tmp_path / "no-pyodide"))
    with running_proxy("--engine", "fake", "--state-db", ":memory:", log_path=tmp_path / "log",
                       ready_timeout_s=60) as (base, _):
        dom = dump(f"{base}/ui/compile", tmp_path / "profile")
    assert dom.attrs["report"].get("data-compiled") == "1", "the report was not drawn"
    assert {r["data-step"] for r in dom.report_rows} == {"doc", "facts", "title", "summary"}


def test_missing_run_in_chromium(proxy, tmp_path):
    out = chromium("--dump-dom", f"{proxy}/ui/workflows/wf-missing", profile=tmp_path / "p")
    assert "No such run" in out.stdout and "wf-missing" in out.stdout
