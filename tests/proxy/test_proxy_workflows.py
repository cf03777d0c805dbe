"""The workflow API on a FakeEngine: dataflow execution, events, tools, bad input."""

from __future__ import annotations

import asyncio
import json

from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine, parse_sse


def llm(node_id, *parts, **extra):
    content = [p if isinstance(p, dict) else {"text": p} for p in parts]
    return {"kind": "llm", "id": node_id, "messages": [{"role": "user", "content": content}],
            **extra}


def ref(node_id, *path):
    return {"ref": node_id, "path": list(path)}


async def run_graph(client, graph):
    resp = await client.post("/v1/workflows", json=graph)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return parse_sse(await resp.text())


def finished(events):
    return {d["step_id"]: d["value"] for e, d in events if e == "step.finished"}


async def test_w1_two_dependencies_in_one_prompt(client, engine: FakeEngine):
    graph = {"name": "w1", "nodes": [
        llm("c", "A=", ref("a"), " B=", ref("b"), " A=", ref("a")),
        {"kind": "input", "id": "a", "value": "alpha"},
        llm("b", "make b")]}
    events = await run_graph(client, graph)
    assert events[0][0] == "run.started" and events[-1][0] == "run.finished"
    out = finished(events)
    # c ran after both a and b, with both values substituted (a twice)
    assert out["c"] == "echo: A=alpha B=echo: make b A=alpha"
    names = [e for e, _ in events]
    assert names.index("step.finished") < len(names) - 1
    order = [d["step_id"] for e, d in events if e == "step.finished"]
    assert order.index("c") > order.index("b")
    assert events[-1][1]["status"] == "succeeded"


async def test_w2_variable_only_prompt_and_fan_out(client):
    graph = {"nodes": [{"kind": "input", "id": "seed", "value": "s"},
                       *[llm(f"f{i}", ref("seed")) for i in range(4)],
                       llm("g", ref("f0"))]}
    out = finished(await run_graph(client, graph))
    assert all(out[f"f{i}"] == "echo: s" for i in range(4))
    assert out["g"] == "echo: echo: s"


async def test_independent_steps_run_concurrently(aiohttp_client, make_app, engine):
    engine.delay_s = 0.05
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    graph = {"nodes": [llm(f"n{i}", f"distinct prompt {i}") for i in range(6)]}
    events = await run_graph(client, graph)
    trace = [r for r in events[-1][1]["trace"] if r["type"] == "step"]
    starts = sorted(r["started_ms"] for r in trace)
    ends = sorted(r["finished_ms"] for r in trace)
    assert starts[-1] < ends[0], "all six independent steps should overlap"


async def test_structured_output_and_field_projection(client):
    tags = {"type": "array", "items": {"type": "string"}}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": tags},
              "required": ["name", "tags"]}
    graph = {"nodes": [llm("e", "extract", contract={"json_schema": schema}),
                       llm("c", "classify", contract={"choices": ["p", "q"]}),
                       llm("u", "name=", ref("e", "name"), " tag0=", ref("e", "tags", "0"))]}
    out = finished(await run_graph(client, graph))
    assert out["e"] == {"name": "x", "tags": ["x"]}
    assert out["c"] == "p"
    assert out["u"] == "echo: name=x tag0=x"


async def test_contract_is_checked_even_after_constrained_decoding(aiohttp_client, make_app,
                                                                  engine):
    engine.responder = lambda req: "not json at all"
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    graph = {"nodes": [llm("e", "x", contract={"json_schema": {"type": "object"}}),
                       llm("down", ref("e")), llm("free", "independent")]}
    events = await run_graph(client, graph)
    failed = {d["step_id"]: d["error"] for e, d in events if e == "step.failed"}
    assert "not valid JSON" in failed["e"]
    assert "skipped: input 'e' failed" in failed["down"]
    assert finished(events)["free"] == "not json at all"  # nothing computed is lost
    assert events[-1][1]["status"] == "failed"


async def test_tool_step_pauses_branch_until_result_posted(client):
    graph = {"nodes": [llm("a", "first"),
                       {"kind": "tool", "id": "t", "name": "lookup",
                        "args": [ref("a")], "kwargs": {"k": {"value": 2}}},
                       llm("b", "after tool: ", ref("t"))]}
    resp = await client.post("/v1/workflows", json=graph)
    assert resp.status == 200
    seen, run_id = [], None
    while True:
        block = (await resp.content.readuntil(b"\n\n")).decode()
        ((event, data),) = parse_sse(block)
        seen.append((event, data))
        if event == "run.started":
            run_id = data["run_id"]
        elif event == "tool.wanted":
            assert data == {"step_id": "t", "name": "lookup", "args": ["echo: first"],
                            "kwargs": {"k": 2}}
            assert not any(e == "step.finished" and d["step_id"] == "b" for e, d in seen)
            for bad in ({}, {"value": 1, "error": "x"}, {"error": None}):
                refused = await client.post(f"/v1/workflows/{run_id}/steps/t/result",
                                            json=bad)  # never taken for a null value
                assert refused.status == 400, bad
                err = (await refused.json())["error"]
                assert "exactly one of 'value'" in err["message"] or "not null" in err["message"]
            r = await client.post(f"/v1/workflows/{run_id}/steps/t/result",
                                  json={"value": {"hits": ["json", "csv"]}})
            assert r.status == 200 and (await r.json())["outcome"] == "delivered"
            again = await client.post(f"/v1/workflows/{run_id}/steps/t/result",
                                      json={"value": 1})
            assert again.status == 200  # a result is taken once: a second post is a no-op
            assert (await again.json())["outcome"] == "duplicate"
        elif event == "run.finished":
            break
    assert finished(seen)["b"] == 'echo: after tool: {"hits": ["json", "csv"]}'
    assert seen[-1][1]["status"] == "succeeded"


async def test_tool_error_fails_its_branch_only(client):
    graph = {"nodes": [{"kind": "tool", "id": "t", "name": "boom"}, llm("b", ref("t")),
                       llm("c", "other")]}
    resp = await client.post("/v1/workflows", json=graph)
    run_id = None
    while True:
        ((event, data),) = parse_sse((await resp.content.readuntil(b"\n\n")).decode())
        if event == "run.started":
            run_id = data["run_id"]
        if event == "tool.wanted":
            await client.post(f"/v1/workflows/{run_id}/steps/t/result",
                              json={"error": "ValueError: no index"})
        if event == "run.finished":
            break
    assert data["failures"]["t"] == "tool 't' raised: ValueError: no index"
    assert "skipped" in data["failures"]["b"] and "c" not in data["failures"]


async def test_invalid_graph_is_rejected_whole_and_proxy_keeps_serving(client, engine):
    bad = {"nodes": [llm("a", ref("b")), llm("b", ref("a")), llm("c", ref("ghost")),
                     llm("d", "x", model="no-such-model")]}
    resp = await client.post("/v1/workflows", json=bad)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_graph"
    assert len(err["problems"]) == 3
    assert not engine.requests, "nothing may run from a rejected graph"
    schema_bad = await client.post("/v1/workflows", json={"nodes": [{"kind": "llm"}]})
    assert schema_bad.status == 400
    assert "nodes.0.llm.id" in json.dumps(await schema_bad.json())
    not_json = await client.post("/v1/workflows", data=b"{nope")
    assert not_json.status == 400 and (await not_json.json())["error"]["param"] == "body"
    ok = await run_graph(client, {"nodes": [llm("a", "still alive")]})
    assert finished(ok)["a"] == "echo: still alive"


async def test_a_tool_that_returned_none_posts_value_null(client):
    graph = {"nodes": [{"kind": "tool", "id": "t", "name": "noop"}, llm("b", "got ", ref("t"))]}
    resp = await client.post("/v1/workflows", json=graph)
    run_id = None
    while True:
        ((event, data),) = parse_sse((await resp.content.readuntil(b"\n\n")).decode())
        if event == "run.started":
            run_id = data["run_id"]
        if event == "tool.wanted":
            r = await client.post(f"/v1/workflows/{run_id}/steps/t/result",
                                  json={"value": None})
            assert r.status == 200 and (await r.json())["outcome"] == "delivered"
        if event == "run.finished":
            break
    assert data["status"] == "succeeded"


async def test_tool_result_for_unknown_run_or_step(client):
    r = await client.post("/v1/workflows/wf-nope/steps/t/result", json={"value": 1})
    assert r.status == 404 and (await r.json())["error"]["code"] == "run_not_found"


async def test_deadline_names_the_step_and_its_queue_time(aiohttp_client, make_app, engine):
    engine.delay_s = 0.2
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    events = await run_graph(client, {"deadline_s": 0.3, "nodes": [
        llm("slow", "y" * 200), llm("after", ref("slow"))]})
    failed = {d["step_id"]: d["error"] for e, d in events if e == "step.failed"}
    assert "deadline of 0.3 s exceeded" in failed["slow"]
    assert "deadline" in failed["after"]


async def test_run_is_kept_for_lookup_and_trace_written(aiohttp_client, make_app, tmp_path):
    from flowlift.proxy import ProxyConfig

    app = make_app(ProxyConfig(trace_dir=tmp_path))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    events = await run_graph(client, {"name": "kept", "nodes": [llm("a", "x")]})
    run_id = events[0][1]["run_id"]
    await asyncio.sleep(0.05)
    got = await (await client.get(f"/v1/workflows/{run_id}")).json()
    assert got["status"] == "succeeded" and got["outputs"] == {"a": "echo: x"}
    lines = (tmp_path / f"{run_id}.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["type"] == "run" and len(lines) == 2


async def test_cancel_run_aborts_engine_requests(aiohttp_client, make_app, engine):
    engine.delay_s = 0.5
    app = make_app()
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    resp = await client.post("/v1/workflows", json={"nodes": [llm("a", "z " * 50)]})
    first = parse_sse((await resp.content.readuntil(b"\n\n")).decode())
    run_id = first[0][1]["run_id"]
    await asyncio.sleep(0.1)
    r = await client.delete(f"/v1/workflows/{run_id}")
    assert (await r.json())["cancelled"] is True
    rest = parse_sse(await resp.text())
    assert rest[-1][1]["status"] == "cancelled"
    assert any(e == "step.failed" and "cancelled" in d["error"] for e, d in rest)
    assert engine.aborted
