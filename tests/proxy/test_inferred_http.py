"""Workflows inferred from plain OpenAI traffic, end to end over HTTP."""

from __future__ import annotations

from flowlift.testing import parse_sse
from tests.upstream_fake import FakeUpstream, chat_json, chunk, sse_bytes, upstream_only_proxy

DOC = ("The Parrot paper (OSDI 2024) exposes application-level dataflow to the serving "
       "system through Semantic Variables, so that dependent requests can be scheduled "
       "together and shared prefixes reused.")


async def chat(client, content, step=None, stream=False, **headers):
    hdrs = {"X-Flowlift-Workflow": "wf-paper", **headers}
    if step:
        hdrs["X-Flowlift-Step"] = step
    resp = await client.post("/v1/chat/completions", headers=hdrs, json={
        "model": "fake-model", "stream": stream,
        "messages": [{"role": "system", "content": "You are a careful analyst. " * 20},
                     {"role": "user", "content": content}]})
    assert resp.status == 200, await resp.text()
    if stream:
        return "".join(d["choices"][0]["delta"].get("content") or ""
                       for _, d in parse_sse(await resp.text())
                       if isinstance(d, dict) and d.get("choices"))
    return (await resp.json())["choices"][0]["message"]["content"]


async def test_plain_traffic_becomes_a_graph_with_edges_and_a_report(client, engine):
    engine.delay_s = 0.005  # each call takes real time, so translate's wait is measurable
    facts = await chat(client, f"Extract the facts: {DOC}", step="extract")
    label = await chat(client, f"Classify these facts: {facts}", step="classify", stream=True)
    await chat(client, f"Summarize {facts} given the label {label}", step="summarize")
    await chat(client, f"Translate to French: {DOC}", step="translate")
    resp = await client.get("/v1/workflows/wf-paper")
    assert resp.status == 200
    doc = await resp.json()
    assert doc["object"] == "workflow.inferred"
    deps = {s["id"]: set(s["depends_on"]) for s in doc["steps"]}
    assert deps["extract"] == set() and deps["translate"] == set()
    assert deps["classify"] == {"extract"}
    assert deps["summarize"] == {"extract", "classify"}
    report = doc["report"]
    assert report["critical_path"] == ["extract", "classify", "summarize"]
    assert report["steps"] == 4
    # the same report a submitted graph gets
    compiled = await client.post("/v1/workflows:compile", json=doc["graph"])
    assert compiled.status == 200
    assert set(await compiled.json()) == set(report)
    assert any(p["step"] == "translate" for p in doc["observed"]["parallelizable"])


async def test_metadata_joins_a_workflow_and_bad_ids_are_400(client):
    resp = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"flowlift_workflow": "wf-meta", "flowlift_step": "only"}})
    assert resp.status == 200
    doc = await (await client.get("/v1/workflows/wf-meta")).json()
    assert [s["id"] for s in doc["steps"]] == ["only"]
    bad = await client.post("/v1/chat/completions", headers={"X-Flowlift-Workflow": "has space"},
                            json={"model": "fake-model",
                                  "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status == 400
    assert (await bad.json())["error"]["param"] == "X-Flowlift-Workflow"


async def test_unknown_workflow_is_a_client_error(client):
    resp = await client.get("/v1/workflows/never-seen")
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "run_not_found"
    assert (await resp.json())["error"]["param"] == "run_id"


async def test_upstream_traffic_joins_too_and_sticks_to_one_replica(aiohttp_client,
                                                                    aiohttp_server):

    answer = "The answer is forty-two, as computed by Deep Thought."
    fakes = [FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": answer}),
                                                         chunk({}, "stop")))])
             for _ in range(3)]
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, *fakes)
    for i, content in enumerate(["What is the answer?", f"Explain: {answer}"]):
        resp = await client.post("/v1/chat/completions", headers={
            "X-Flowlift-Workflow": "wf-up", "X-Flowlift-Step": f"s{i}"}, json={
            "model": "up", "stream": True, "messages": [{"role": "user", "content": content}]})
        assert resp.status == 200
        await resp.read()
    assert sorted(len(f.received) for f in fakes) == [0, 0, 2]  # one replica for the workflow
    assert all("x-flowlift-workflow" not in {k.lower() for k in r.headers}
               for f in fakes for r in f.received)
    doc = await (await client.get("/v1/workflows/wf-up")).json()
    assert {s["id"]: s["depends_on"] for s in doc["steps"]} == {"s0": [], "s1": ["s0"]}


async def test_flowlift_metadata_stays_in_the_proxy(aiohttp_client, aiohttp_server):

    fake = FakeUpstream([FakeUpstream.json(chat_json("ok"))])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    for meta, expected in (({"flowlift_workflow": "w1", "team": "a"}, {"team": "a"}),
                           ({"flowlift_workflow": "w1", "flowlift_step": "s"}, None)):
        resp = await client.post("/v1/chat/completions", json={
            "model": "up", "messages": [{"role": "user", "content": "hi"}], "metadata": meta})
        assert resp.status == 200
        assert fake.received[-1].json().get("metadata") == expected
    doc = await (await client.get("/v1/workflows/w1")).json()
    assert [s["id"] for s in doc["steps"]] == ["call-1", "s"]
