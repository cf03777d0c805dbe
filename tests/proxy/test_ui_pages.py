"""The proxy's pages (/ui/workflows/{id}, /ui/compile), the report in
GET /v1/workflows/{id} and the progress route, on a FakeEngine (no browser here: see
test_ui_chromium.py)."""

from __future__ import annotations

import asyncio
import re
from html.parser import HTMLParser

from flowlift.proxy import ProxyConfig
from flowlift.proxy.state import STATE
from flowlift.proxy.ui.pages import json_for_script
from flowlift.testing import parse_sse

EVIL_ID = '<img src=x onerror="alert(1)">'
EVIL_TEXT = "</script><script>alert(2)</script>"


def llm(node_id, *parts, **extra):
    content = [p if isinstance(p, dict) else {"text": p} for p in parts]
    return {"kind": "llm", "id": node_id, "messages": [{"role": "user", "content": content}],
            **extra}


def chain_graph(name="chain"):
    """a -> b -> c is the long chain; s is one short independent step."""
    return {"name": name, "nodes": [
        llm("a", "one two three four five six"),
        llm("b", "seven eight nine ", {"ref": "a"}),
        llm("c", "ten eleven ", {"ref": "b"}),
        llm("s", "short", params={"max_tokens": 1})]}


async def run(client, graph):
    resp = await client.post("/v1/workflows", json=graph)
    assert resp.status == 200, await resp.text()
    events = parse_sse(await resp.text())
    return events[0][1]["run_id"], events


class Bars(HTMLParser):
    """Collects the Gantt's bars and every element name seen."""

    def __init__(self) -> None:
        super().__init__()
        self.bars: list[dict[str, str | None]] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "rect" and "bar" in (a.get("class") or "").split():
            self.bars.append(a)


def parse(html: str) -> Bars:
    p = Bars()
    p.feed(html)
    return p


async def test_run_page_draws_stages_and_only_the_critical_path(client, engine):
    engine.delay_s = 0.01
    run_id, _ = await run(client, chain_graph())
    doc = await (await client.get(f"/v1/workflows/{run_id}")).json()
    assert doc["report"]["critical_path"] == ["a", "b", "c"]
    resp = await client.get(f"/ui/workflows/{run_id}")
    assert resp.status == 200 and resp.content_type == "text/html"
    csp = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'nonce-" in csp
    html = await resp.text()
    page = parse(html)
    stages = {b["data-stage"] for b in page.bars}
    assert {"prefill", "decode"} <= stages
    critical = {b["data-step"] for b in page.bars if b.get("data-critical") == "measured"}
    assert critical == {"a", "b", "c"}
    assert all("critical" in b["class"].split() for b in page.bars
               if b["data-step"] in critical)
    assert 'id="report-data"' in html and "flowliftRenderReport" in html
    assert "Critical path (measured)</b>: a \u2192 b \u2192 c" in html
    outside = re.findall(r"https?://[^\s\"'<>]+", html.replace("http://www.w3.org/2000/svg", ""))
    assert outside == []  # nothing loaded from elsewhere (the SVG namespace is a name)


async def test_user_data_is_escaped_everywhere(client):
    graph = {"name": EVIL_TEXT, "nodes": [
        llm(EVIL_ID, f"say {EVIL_TEXT}"),
        llm("after", "then ", {"ref": EVIL_ID}),
        {"kind": "tool", "id": "t", "name": EVIL_TEXT, "args": []}]}
    resp = await client.post("/v1/workflows", json=graph)
    stream = resp.content
    run_id = None
    while True:  # answer the tool with more markup
        block = (await stream.readuntil(b"\n\n")).decode()
        ((event, data),) = parse_sse(block)
        if event == "run.started":
            run_id = data["run_id"]
        if event == "tool.wanted":
            await client.post(f"/v1/workflows/{run_id}/steps/t/result",
                              json={"value": {"html": EVIL_ID}})
        if event == "run.finished":
            break
    html = await (await client.get(f"/ui/workflows/{run_id}")).text()
    page = parse(html)
    assert "img" not in page.tags
    assert page.tags.count("script") == 3  # report.js, its init call, the JSON data
    assert EVIL_ID not in html and EVIL_TEXT not in html
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html
    assert {b["data-step"] for b in page.bars} >= {EVIL_ID, "after"}  # unescaped by parser
    assert json_for_script({"x": EVIL_TEXT}) == \
        '{"x": "\\u003c/script\\u003e\\u003cscript\\u003ealert(2)\\u003c/script\\u003e"}'


async def test_unknown_run_is_a_404_page(client):
    resp = await client.get("/ui/workflows/wf-nope")
    assert resp.status == 404 and resp.content_type == "text/html"
    assert "No such run" in await resp.text()
    bad = await client.get("/ui/workflows/%3Cscript%3E")
    assert bad.status == 404 and "<script>" not in (await bad.text()).split("</main>")[0]


async def test_compile_page_has_the_example_graph_and_script(client):
    resp = await client.get("/ui/compile")
    assert resp.status == 200
    html = await resp.text()
    assert '<textarea id="graph"' in html and "&quot;kind&quot;: &quot;llm&quot;" in html
    assert "/v1/workflows:compile" in html and "flowliftRenderReport" in html
    assert (await client.get("/ui", allow_redirects=False)).headers["Location"] == "/ui/"


async def test_stored_run_gets_its_report_compiled_again(aiohttp_client, make_app, tmp_path):
    config = ProxyConfig(state_path=tmp_path / "state.sqlite")
    app = make_app(config)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    run_id, _ = await run(client, chain_graph())
    await client.close()
    app2 = make_app(config)  # a restarted proxy: the run is only in the store
    client2 = await aiohttp_client(app2)
    await app2[STATE].ready.wait()
    assert run_id not in app2[STATE].runs.finished
    doc = await (await client2.get(f"/v1/workflows/{run_id}")).json()
    assert doc["status"] == "succeeded" and doc["report"]["critical_path"] == ["a", "b", "c"]
    page = parse(await (await client2.get(f"/ui/workflows/{run_id}")).text())
    assert {b["data-step"] for b in page.bars if b.get("data-critical")} == {"a", "b", "c"}
    progress = await (await client2.get(f"/v1/workflows/{run_id}/progress")).json()
    assert progress["counts"]["done"] == 4 and progress["status"] == "succeeded"


async def test_progress_counts_a_running_run(client, engine):
    engine.delay_s = 0.05
    resp = await client.post("/v1/workflows", json=chain_graph())
    ((_, started),) = parse_sse((await resp.content.readuntil(b"\n\n")).decode())
    run_id = started["run_id"]
    await asyncio.sleep(0.1)
    got = await (await client.get(f"/v1/workflows/{run_id}/progress")).json()
    assert got["steps"] == 4 and got["status"] == "running"
    counts = got["counts"]
    assert sum(counts.values()) == 4 and counts["pending"] >= 1  # c waits for b
    assert counts["running"] + counts["queued"] + counts["done"] >= 2
    live = await (await client.get(f"/ui/workflows/{run_id}")).text()
    assert re.search(r'http-equiv="refresh" content="2"', live)
    await resp.text()
    done = await (await client.get(f"/v1/workflows/{run_id}/progress")).json()
    assert done["counts"]["done"] == 4
    unknown = await client.get("/v1/workflows/wf-none/progress")
    assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "run_not_found"


async def test_failed_run_shows_the_failed_try_and_the_skipped_step(client, engine):
    engine.responder = lambda req: "not json"
    graph = {"name": "fails", "nodes": [
        llm("parse", "give json", contract={"json_schema": {"type": "object"}}),
        llm("then", "use ", {"ref": "parse"})]}
    run_id, events = await run(client, graph)
    assert events[-1][1]["status"] == "failed"
    html = await (await client.get(f"/ui/workflows/{run_id}")).text()
    page = parse(html)
    assert [(b["data-step"], b["data-stage"]) for b in page.bars
            if b["data-stage"] == "failed_try"] == [("parse", "failed_try")]
    assert {b["data-step"] for b in page.bars if b.get("data-critical")} == {"parse"}
    assert "then" not in {b["data-step"] for b in page.bars}
    assert "Critical path (measured)</b>: parse</li>" in html  # not through the skipped step
    assert "skipped: input &#x27;parse&#x27; failed" in html
    assert 'class="status status-failed"' in html
