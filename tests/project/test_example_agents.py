"""The agents example (examples/agents): both variants end to end on a scripted
FakeEngine -- answers, turns, a bad tool call sent back to the model, and a question
that reaches ``max_turns`` reported on its row while the example runs to the end."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re

from examples.agents import research
from flowlift.local_engine.base import GenerationRequest
from flowlift.testing import tool_calls_text

Q = research.QUESTIONS  # the first three: csv, zlib, re


def _question(request: GenerationRequest) -> research.Question:
    user = next(m.content for m in request.messages if m.role == "user")
    return next(q for q in Q if q.text in user)


def _agent_turn(request: GenerationRequest) -> str:
    """csv: search, answer (2 turns); zlib: a bad call, read, answer (3); re: searches
    until max_turns."""
    q = _question(request)
    done = sum(m.content.startswith("Result of") for m in request.messages)
    if q.module == "csv":
        return tool_calls_text(("search", {"query": "comma separated"})) if done == 0 \
            else "csv: it reads and writes CSV files."
    if q.module == "zlib":
        script = [tool_calls_text(("read", {"name": "zlib"})),  # wrong argument name
                  tool_calls_text(("read", {"module": "zlib"})),
                  "zlib compresses with GNU zip."]
        return script[done]
    return tool_calls_text(("search", {"query": "regex"}))


def _loop_turn(request: GenerationRequest) -> str:
    """csv: search, answer (2 turns); zlib: search, read, answer (3); re: searches until
    max_turns."""
    q = _question(request)
    done = request.messages[-1].content.count(" returned: ")
    if q.module == "csv":
        script = [("search", "comma separated values"), ("answer", "csv, for CSV files")]
    elif q.module == "zlib":
        script = [("search", "GNU zip"), ("read", "zlib"), ("answer", "zlib compresses")]
    else:
        script = [("search", "regular expressions")] * 99
    tool, arg = script[done]
    return json.dumps({"tool": tool, "input": arg})


def responder(seen: list[GenerationRequest]):
    def respond(request: GenerationRequest) -> str:
        seen.append(request)
        loop = '"tool": "search"' in request.messages[0].content
        return _loop_turn(request) if loop else _agent_turn(request)
    return respond


def _rows(block: str) -> dict[str, tuple[str, int, str]]:
    """expected module -> (ok, turns, answer) from a variant's printed table."""
    rows = {}
    for line in block.splitlines():
        m = re.match(r"\s+\d+\s+(\S+)\s+(yes|no)\s+(\d+)\s+(.*)$", line)
        if m:
            rows[m.group(1)] = (m.group(2), int(m.group(3)), m.group(4))
    return rows


async def test_both_variants_run_end_to_end_on_a_scripted_engine(
        client, engine, tmp_path, monkeypatch):
    seen: list[GenerationRequest] = []
    engine.responder = responder(seen)
    monkeypatch.setenv("FLOWLIFT_BASE_URL", str(client.make_url("")).rstrip("/"))
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return research.main(["--limit", "3", "--trace-dir", str(tmp_path)])

    assert await asyncio.to_thread(run) == 0
    text = out.getvalue()
    step_block, loop_block = text.split("== agent step")[1].split("== explicit loop")
    step_rows, loop_rows = _rows(step_block), _rows(loop_block)

    assert step_rows["csv"][:2] == ("yes", 2) and "reads and writes CSV" in step_rows["csv"][2]
    assert step_rows["zlib"][:2] == ("yes", 3)
    # the last turn (tools off) answered with a call in JSON: tried once more, then failed
    assert step_rows["re"][:2] == ("no", research.MAX_TURNS + 1)
    assert "FAILED" in step_rows["re"][2] and "max_turns" in step_rows["re"][2]
    assert loop_rows["csv"][:2] == ("yes", 2) and loop_rows["zlib"][:2] == ("yes", 3)
    assert loop_rows["re"][:2] == ("no", research.MAX_TURNS)
    assert "FAILED" in loop_rows["re"][2] and "max_turns" in loop_rows["re"][2]
    assert "2/3 answers name the expected module; 1 failed" in step_block
    assert "2/3 answers name the expected module; 1 failed" in loop_block

    # the bad call went back to the model as its result; the tools' output reached it
    loop = [r for r in seen if '"tool": "search"' in r.messages[0].content]
    agent_zlib = [r for r in seen if r not in loop and _question(r).module == "zlib"]
    assert "error: bad arguments for read" in agent_zlib[1].messages[-1].content
    assert "Interface to the liblzma" not in agent_zlib[2].messages[-1].content
    assert "compression and decompression" in agent_zlib[2].messages[-1].content
    loop_csv = [r for r in loop if _question(r).module == "csv"]
    assert "CSV parsing and writing" in loop_csv[-1].messages[-1].content

    # one run (one id, one trace) per variant, and the stage split printed for each
    run_ids = re.findall(r"run id: (wf-\w+) \((\w+)\); trace: (\S+)", text)
    assert len(run_ids) == 2 and run_ids[0][0] != run_ids[1][0]
    for (run_id, _, trace), steps in zip(run_ids, (3, 20), strict=True):
        with open(trace, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        assert {r["run_id"] for r in records} == {run_id}
        # the loop's run holds every turn (11 decide steps) and tool call (9 @tool steps)
        assert sum(r["type"] == "step" for r in records) == steps
    assert text.count("decode") >= 2  # wf.report()'s stage table, once per variant


async def test_the_proxy_tools_variant_runs_search_and_read_on_the_proxy(
        aiohttp_client, tmp_path, monkeypatch):
    """--variant proxy with examples/agents/proxy_tools.toml: the same answers as the
    agent step, and no tool call ever reaches the app (no ``tool.wanted``)."""
    from pathlib import Path

    from flowlift.proxy import create_app
    from flowlift.proxy.config import load_config
    from flowlift.proxy.state import STATE
    from flowlift.testing import FakeEngine

    engine = FakeEngine(["fake-model"])
    seen: list[GenerationRequest] = []
    engine.responder = responder(seen)
    cfg = load_config(Path(research.__file__).with_name("proxy_tools.toml"))
    app = create_app({"fake-model": engine}, file_config=cfg)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    monkeypatch.setenv("FLOWLIFT_BASE_URL", str(client.make_url("")).rstrip("/"))
    out = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out):
            return research.main(["--variant", "proxy", "--limit", "3",
                                  "--trace-dir", str(tmp_path)])

    assert await asyncio.to_thread(run) == 0
    text = out.getvalue()
    rows = _rows(text.split("== agent step, tools on the proxy")[1])
    assert rows["csv"][:2] == ("yes", 2) and rows["zlib"][:2] == ("yes", 3)
    assert rows["re"][:2] == ("no", research.MAX_TURNS + 1)  # the last turn tried twice
    zlib = [r for r in seen if _question(r).module == "zlib"]
    assert "error: bad arguments for read" in zlib[1].messages[-1].content
    assert "compression and decompression" in zlib[2].messages[-1].content
    run_id = re.findall(r"run id: (wf-\w+)", text)[0]
    names = [n for _, n, _ in app[STATE].runs.live(run_id).log.history()]
    assert "tool.result" in names and "tool.wanted" not in names


def test_the_agents_run_on_the_larger_model_when_the_proxy_serves_it():
    import httpx
    import respx

    with respx.mock:
        respx.get("http://pair/v1/models").respond(json={"data": [
            {"id": "small"}, {"id": "large"}, {"id": "Qwen2.5-Coder-0.5B-Instruct"}]})
        respx.get("http://single/v1/models").respond(json={"data": [{"id": "fake-model"}]})
        respx.get("http://down/v1/models").mock(side_effect=httpx.ConnectError("refused"))
        assert research.agent_model("http://pair") == "large"
        assert research.agent_model("http://single") is None  # the proxy's default
        assert research.agent_model("http://down") is None


def test_tool_call_validity_counts_agent_calls_and_loop_decisions():
    trace = [
        {"type": "run"},
        {"type": "step", "name": "research", "tool_calls": [
            {"outcome": "ok"}, {"outcome": "invalid"}, {"outcome": "error"}]},
        {"type": "step", "name": "decide", "attempts": [
            {"outcome": "contract_failed"}, {"outcome": "ok"}]},
        {"type": "step", "name": "search"},
    ]
    assert research.tool_call_validity(trace) == (3, 5)
