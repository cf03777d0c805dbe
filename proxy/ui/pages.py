"""The proxy's pages: recent runs, a run's timeline and a compile page (HTML, nothing
fetched from outside the machine).

* ``GET /ui/`` -- the most recent runs of the run store (``?state=`` filters, ``?after=``
  pages on), each linking to its timeline; ``/ui`` redirects here.
* ``GET /ui/workflows/{run_id}`` -- the run as a Gantt chart (one row per step, bars
  split into stage colours, the measured critical path highlighted, see
  :mod:`flowlift.tracing.timeline`), the compiler's report beside it and a table of
  steps with their outputs, then each llm step's resolved prompt (the messages its
  model received). It shows exactly what ``GET /v1/workflows/{run_id}`` answers. An
  unknown run is a 404 page; a running run's page reloads every 2 s.
* ``GET /ui/compile`` -- paste a graph (``?run=RUN_ID``: that run's recorded graph), see
  the compiler's report. With the browser compiler installed (``scripts/fetch_pyodide.sh``)
  the page runs flowlift's compiler itself under Pyodide (:mod:`flowlift.proxy.ui.offline`)
  and sends nothing anywhere; without it, it calls ``POST /v1/workflows:compile``.

Pages are self-contained: CSS and JS are package data (``static/``) inlined into the
page, under a Content-Security-Policy that allows only this page's own scripts (a
nonce) and requests back to this proxy. Every text from a graph or a run is escaped
(:func:`html.escape`; JSON inside ``<script type="application/json">`` has ``<``, ``>``
and ``&`` escaped; the JS writes text with ``textContent`` only).
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
from html import escape
from importlib import resources
from typing import Any, cast
from urllib.parse import quote

from aiohttp import web

from flowlift.errors import RequestError
from flowlift.proxy.state import STATE
from flowlift.proxy.store.base import RunSummary
from flowlift.proxy.tenants import tenant_of
from flowlift.proxy.ui import offline
from flowlift.proxy.ui.offline import boot_config
from flowlift.proxy.ui.svg import gantt_svg, legend_html
from flowlift.proxy.workflows import api as workflows
from flowlift.tracing.summary import stage_summary
from flowlift.tracing.timeline import (
    STAGE_LABELS,
    gantt,
    path_stage_ms,
    report_deps,
    split_records,
)

routes = web.RouteTableDef()
NO_ICON = '<link rel="icon" href="data:,">'  # no /favicon.ico request
OUTPUT_PREVIEW_CHARS = 240
ARROW = " \u2192 "


@functools.cache
def static(name: str) -> str:
    """A file of ``static/`` (package data)."""
    return resources.files("flowlift.proxy.ui").joinpath("static", name).read_text("utf-8")


def json_for_script(value: Any) -> str:
    """JSON safe inside ``<script type="application/json">`` (no ``</script>`` breakout)."""
    return (json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))


def page(title: str, body: str, *, scripts: tuple[str, ...] = (), init_js: str = "",
         status: int = 200, refresh_s: int | None = None,
         script_src: str = "") -> web.Response:
    """A whole HTML page with the shared stylesheet, the given ``static/`` scripts and
    then ``init_js`` (our own code, never data); ``script_src``: more CSP script sources
    (the compile page's ``'self' 'wasm-unsafe-eval'`` for Pyodide)."""
    nonce = secrets.token_urlsafe(16)
    js = "".join(f'<script nonce="{nonce}">{code}</script>'
                 for code in (*map(static, scripts), init_js) if code)
    meta = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    html = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">{meta}{NO_ICON}'
            f"<title>{escape(title)}</title><style nonce=\"{nonce}\">{static('ui.css')}</style>"
            f'</head><body><header><h1>flowlift</h1><nav><a href="/ui/">runs</a>'
            f'<a href="/ui/compile">compile a graph</a></nav></header>'
            f"<main>{body}</main>{js}</body></html>")
    scripts_csp = " ".join(filter(None, (f"'nonce-{nonce}'", script_src)))
    csp = (f"default-src 'none'; script-src {scripts_csp}; style-src 'nonce-{nonce}'; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; "
           "frame-ancestors 'none'")
    return web.Response(text=html, status=status, content_type="text/html", headers={
        "Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"})


def _ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def _preview(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= OUTPUT_PREVIEW_CHARS else text[:OUTPUT_PREVIEW_CHARS] + "\u2026"


def _head(doc: dict[str, Any], head: dict[str, Any], steps: list[Any]) -> str:
    summary = stage_summary(doc.get("trace") or [])
    tok = summary["tokens"]
    status = str(doc.get("status", "?"))
    return (f"<h2>{escape(str(head.get('name') or 'workflow'))} "
            f"<code>{escape(str(doc.get('run_id')))}</code> "
            f'<span class="status status-{escape(status)}">{escape(status)}</span></h2>'
            f'<p class="facts"><b>{_ms(head.get("wall_ms"))}</b> wall time · '
            f"<b>{len(steps)}</b> steps, <b>{len(doc.get('failures') or {})}</b> failed · "
            f"class {escape(str(head.get('class', '-')))} · tokens: {tok['prompt']} prompt "
            f"({tok['cached']} from prefix cache), {tok['completion']} generated · "
            f'<a href="/v1/workflows/{escape(str(doc.get("run_id")))}">JSON</a> · '
            f'<a href="/ui/compile?run={quote(str(doc.get("run_id")))}">compile its graph</a>'
            "</p>")


def _path_html(steps: list[Any], path: tuple[str, ...], planned: tuple[str, ...],
               wall_ms: float) -> str:
    if not path:
        return '<p class="path">No step has finished yet.</p>'
    split = path_stage_ms(steps, path)
    parts = ", ".join(f"{escape(STAGE_LABELS[s])} {_ms(v)}" for s, v in split.items() if v >= 0.5)
    planned_txt = ("the same steps" if list(planned) == list(path)
                   else ARROW.join(escape(p) for p in planned) or "-")
    return (f'<ul class="path"><li><b>Critical path (measured)</b>: '
            f"{ARROW.join(escape(p) for p in path)}</li>"
            f"<li>{_ms(sum(split.values()))} of the {_ms(wall_ms)} wall time in its steps: "
            f"{parts or '-'}</li><li>Compiler's planned critical path: {planned_txt}</li></ul>")


def _estimate_cells(planned: dict[str, Any] | None, s: dict[str, Any]) -> str:
    """The compiler's estimate against the measurement: ``est / took`` (the step's time
    from dispatch to its stored output) and ``out est/got`` (output tokens)."""
    if planned is None or s.get("kind") != "llm":
        return "<td></td><td></td>"
    started, finished = s.get("started_ms"), s.get("finished_ms")
    took = _ms(finished - started) if started is not None and finished is not None else "-"
    got = s.get("completion_tokens", 0) if finished is not None else "-"
    return (f'<td class="num">{_ms(planned.get("est_ms"))} / {took}</td>'
            f'<td class="num">{planned.get("output_tokens", "-")}/{got}</td>')


def _steps_table(doc: dict[str, Any], steps: list[Any], critical: set[str]) -> str:
    outputs, failures = doc.get("outputs") or {}, doc.get("failures") or {}
    skipped = doc.get("skipped") or {}  # not taken (a condition, a group resolved)
    planned = {n["step_id"]: n for n in (doc.get("report") or {}).get("nodes") or []}
    cols = ("queue", "prefill", "decode", "validate", "tool_wait")
    head = "".join(f'<th class="num">{escape(STAGE_LABELS[c].split(" (")[0])}</th>'
                   for c in cols)
    rows = []
    for s in steps:
        sid = s["step_id"]
        stages = s.get("stages_ms") or {}
        nums = "".join(f'<td class="num">{_ms(stages.get(c)) if c in stages else ""}</td>'
                       for c in cols)
        if sid in failures:
            out = f'<td class="out err">{escape(_preview(failures[sid]))}</td>'
        elif sid in skipped and sid not in outputs:
            out = f'<td class="out">skipped: {escape(_preview(skipped[sid]))}</td>'
        else:
            out = f'<td class="out">{escape(_preview(outputs[sid])) if sid in outputs else ""}</td>'
        rows.append(f'<tr{" class=critical" if sid in critical else ""}>'
                    f"<td>{escape(sid)}</td><td>{escape(str(s.get('kind', '')))}</td>"
                    f"<td>{escape(str(s.get('model') or ''))}</td>"
                    f"<td>{escape(str(s.get('status', '')))}</td>{nums}"
                    f'<td class="num">{s.get("prompt_tokens", 0)}/{s.get("cached_tokens", 0)}/'
                    f'{s.get("completion_tokens", 0)}</td>'
                    f'<td class="num">{len(s.get("attempts") or [])}</td>'
                    f"{_estimate_cells(planned.get(sid), s)}{out}</tr>")
    return (f'<section class="steps"><h3>Steps</h3><table><tr><th>step</th><th>kind</th>'
            f"<th>model</th><th>status</th>{head}<th class=num>tokens in/cached/out</th>"
            f"<th class=num>tries</th><th class=num>est / took</th>"
            f"<th class=num>out est/got</th><th>output or error</th></tr>{''.join(rows)}</table>"
            "</section>")


def _prompts_html(doc: dict[str, Any]) -> str:
    """Each llm step's resolved prompt, folded (``<details>``), every text escaped."""
    prompts = doc.get("prompts") or {}
    if not prompts:
        return ""
    items = "".join(
        f"<details><summary>{escape(str(sid))}</summary><pre>"
        + "".join(f"<b>{escape(str(m.get('role')))}</b>: {escape(str(m.get('content')))}\n"
                  for m in messages)
        + "</pre></details>" for sid, messages in prompts.items())
    return ('<section class="prompts"><h3>Prompts</h3><p class="facts">What each model '
            f"received, references resolved.</p>{items}</section>")


def timeline_body(doc: dict[str, Any]) -> str:
    """The body of a run's page from ``GET /v1/workflows/{run_id}``'s answer."""
    report = doc.get("report")
    records = doc.get("trace") or []
    head, steps = split_records(records)
    chart = gantt(records, report_deps(report), (report or {}).get("critical_path", ()))
    used = {b.stage for r in chart.rows for b in r.bars}
    return (_head(doc, head, steps)
            + '<div class="cols"><section class="chart"><h3>Timeline</h3>'
            + legend_html(used, bool(chart.restarts)) + gantt_svg(chart)
            + _path_html(steps, chart.critical_path, chart.planned_path, chart.wall_ms)
            + '</section><aside class="report" id="report"><noscript>The report needs '
            "JavaScript; the JSON link above has it.</noscript></aside></div>"
            + _steps_table(doc, [r.record for r in chart.rows], set(chart.critical_path))
            + _prompts_html(doc)
            + f'<script type="application/json" id="report-data">{json_for_script(report)}'
            "</script>")


_RENDER_REPORT = ("window.flowliftRenderReport(document.getElementById('report'), "
                  "JSON.parse(document.getElementById('report-data').textContent));")


@routes.get("/ui/workflows/{run_id}")
async def workflow_page(request: web.Request) -> web.Response:
    run_id = request.match_info["run_id"]
    try:
        # aiohttp's route decorator types every handler as returning StreamResponse
        resp = cast(web.Response, await workflows.get_run(request))
    except RequestError as exc:
        return page("flowlift: no such run", '<section class="notfound"><h2>No such run</h2>'
                    f"<p>{escape(exc.message)}.</p><p>Runs are kept in the proxy's state "
                    "database for 7 days; check the id (it starts with <code>wf-</code>) "
                    "or the proxy's <code>--state-db</code>.</p></section>", status=404)
    doc = json.loads(resp.text or "{}")
    if "trace" not in doc:  # a workflow inferred from OpenAI traffic: no recorded stages
        body = (f"<h2>Inferred workflow <code>{escape(run_id)}</code></h2><p>Built from plain "
                "OpenAI traffic: no stage timings were recorded, so there is no timeline. "
                f'See <a href="/v1/workflows/{escape(run_id)}">the JSON</a>.</p>'
                '<aside class="report" id="report"></aside>'
                f'<script type="application/json" id="report-data">'
                f"{json_for_script(doc.get('report'))}</script>")
    else:  # 4000 steps take ~0.3 s to draw (bench/ui_render.py): off the event loop
        body = await asyncio.to_thread(timeline_body, doc)
    return page(f"flowlift: {run_id}", body, scripts=("report.js",), init_js=_RENDER_REPORT,
                refresh_s=2 if doc.get("status") == "running" else None)


def example_graph(model: str | None) -> dict[str, Any]:
    """The compile page's starting graph: two steps from one input, a third over both,
    on ``model`` (``None`` while the proxy serves none: the steps then name no model)."""
    def llm(step_id: str, max_tokens: int, *parts: dict[str, str]) -> dict[str, Any]:
        return {"kind": "llm", "id": step_id, "model": model, "params": {
            "max_tokens": max_tokens}, "messages": [{"role": "user", "content": list(parts)}]}

    return {"name": "example", "class": "interactive", "nodes": [
        {"kind": "input", "id": "doc", "value": "flowlift keeps the shape of a workflow."},
        llm("facts", 64, {"text": "List the facts in: "}, {"ref": "doc"}),
        llm("title", 16, {"text": "A title for: "}, {"ref": "doc"}),
        llm("summary", 96, {"text": "Summarize "}, {"ref": "facts"}, {"text": " as "},
            {"ref": "title"})]}


COMPILE_CSP_SCRIPTS = "'self' 'wasm-unsafe-eval'"
"""Pyodide: its modules are imported from this origin and compile WebAssembly."""


def compile_body(graph_text: str, boot: dict[str, Any] | None, *, intro: str = "") -> str:
    """The compile page's body: the graph ``graph_text`` in a form, the report's places,
    and ``boot`` (:func:`flowlift.proxy.ui.offline.boot_config`; ``None``: the proxy
    compiles) as JSON for compile.js."""
    where = ("The compiler runs in this page (Pyodide, loaded from this machine): nothing you "
             "paste is sent anywhere; cost figures are the defaults and the tokenizer the "
             "approximate one, as <code>flowlift compile --local</code>." if boot is not None
             else "The proxy's compiler answers with its plan under this proxy's tokenizers "
             "and measured cost models (the browser compiler is not installed: "
             "<code>bash scripts/fetch_pyodide.sh</code>).")
    return ('<section class="compile"><h2>Compile a graph</h2><p class="facts">Paste a graph '
            "document (the wire format: <code>workflow(..., submit=False)</code> then "
            "<code>wf.graph().to_wire()</code>), or a workflow's recorded graph. "
            f"{intro}Nothing runs.</p>"
            f'<p class="facts" id="compiler-state">{where}</p>'
            '<form id="compile-form"><textarea id="graph" spellcheck="false">'
            f"{escape(graph_text)}</textarea>"
            '<br><button type="submit">Compile</button></form><ul class="errors" id="errors">'
            '</ul><div class="report" id="report"></div><details class="report-text" open><summary>'
            'What <code>flowlift compile --local</code> prints</summary>'
            '<pre id="report-text"></pre></details>'
            f'<script type="application/json" id="compiler-boot">{json_for_script(boot)}'
            "</script></section>")


def static_compile_page() -> dict[str, str]:
    """The compile page as static files (``index.html`` and the CSS/JS it links), for
    :func:`flowlift.proxy.ui.offline.build_static`: no proxy behind it."""
    body = compile_body(json.dumps(example_graph(None), indent=2), boot_config())
    csp = (f"default-src 'none'; script-src {COMPILE_CSP_SCRIPTS}; style-src 'self'; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")
    html = ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"{NO_ICON}<title>flowlift: compile a graph</title>"
            '<link rel="stylesheet" href="ui.css">'
            "</head><body><header><h1>flowlift</h1></header>"
            f'<main>{body}</main><script src="report.js"></script>'
            '<script src="compile.js"></script></body></html>')
    return {"index.html": html, **{n: static(n) for n in ("ui.css", "report.js", "compile.js")}}


@routes.get("/ui/compile")
async def compile_page(request: web.Request) -> web.Response:
    """The compile page; ``?run=RUN_ID`` fills in that workflow's recorded graph."""
    state = request.app[STATE]
    run_id = request.query.get("run")
    if run_id:
        try:
            graph = await workflows.recorded_graph(state, run_id, tenant_of(request))
        except RequestError as exc:
            return page("flowlift: no such run", '<section class="notfound"><h2>No such '
                        f"run</h2><p>{escape(exc.message)}.</p></section>", status=404)
    else:
        graph = example_graph(state.backends.default_model)
    body = compile_body(json.dumps(graph, indent=2, ensure_ascii=False), boot_config())
    return page("flowlift: compile a graph", body, scripts=("report.js", "compile.js"),
                script_src=COMPILE_CSP_SCRIPTS)


INDEX_PAGE = 50


def _when(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch_s)) + " UTC"


def _took(run: RunSummary) -> str:
    return "" if run.status == "running" else _ms(1000 * (run.updated_at - run.created_at))


def runs_body(runs: list[RunSummary], more: bool, state: str | None) -> str:
    """The body of the index page: a table of ``runs`` (newest first)."""
    rows = "".join(
        f'<tr><td><a href="/ui/workflows/{escape(r.run_id)}"><code>{escape(r.run_id)}</code>'
        f"</a></td><td>{escape(r.name)}</td>"
        f'<td><span class="status status-{escape(r.status)}">{escape(r.status)}</span></td>'
        f"<td>{_when(r.created_at)}</td>"
        f'<td class="num">{_took(r)}</td></tr>' for r in runs)
    query = f"&state={quote(state)}" if state else ""
    nxt = (f'<p><a href="/ui/?after={quote(runs[-1].run_id)}{query}">older runs</a></p>'
           if more and runs else "")
    filters = " · ".join(f'<a href="/ui/?state={s}">{s}</a>'
                         for s in ("running", "succeeded", "failed", "cancelled"))
    shown = f" ({escape(state)})" if state else ""
    table = (f"<table><tr><th>run</th><th>name</th><th>status</th><th>started</th>"
             f"<th class=num>took</th></tr>{rows}</table>" if runs
             else "<p>No runs yet: submit one with the SDK or <code>flowlift run</code>.</p>")
    return (f'<section class="runs"><h2>Recent runs{shown}</h2><p class="facts">'
            f'<a href="/ui/">all</a> · {filters} · <a href="/v1/workflows">JSON</a></p>'
            f"{table}{nxt}</section>")


@routes.get("/ui/")
async def runs_page(request: web.Request) -> web.Response:
    state = request.query.get("state") or None
    runs, more = await request.app[STATE].runs.recent(
        status=state, limit=INDEX_PAGE, after=request.query.get("after"),
        tenant=tenant_of(request))
    return page("flowlift: runs", runs_body(runs, more, state),
                refresh_s=5 if any(r.status == "running" for r in runs) else None)


@routes.get("/ui")
async def ui_index(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


def setup(app: web.Application) -> None:
    """Add the pages, and the browser compiler's files, to the proxy's app."""
    app.add_routes(routes)
    offline.setup(app)
