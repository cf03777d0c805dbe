"""The research agent's 12 questions (examples/agents) on one model, every way it can be
run (issue 34): answers right, tool calls made and valid, answers given after at least
one tool result.

Variants (``--variants``):

* ``step``: the agent step with the app's ``@tool`` functions
  (``research.research``), through a flowlift proxy;
* ``proxy``: the same agent step with the tools on the proxy (``[tools.docs]`` of the
  proxy's config, ``research.research_on_proxy``);
* ``loop``: the explicit loop (``decide`` with a JSON contract, in an open run);
* ``client``: a plain OpenAI-client loop (``/v1/chat/completions`` with ``tools``,
  ``tool_choice: "auto"``, temperature 0, ``max_tokens`` 128, at most 6 turns, the
  tools run in the client): what a user of a stock ``vllm serve`` (``--base-url`` of
  one, started with ``--enable-auto-tool-choice --tool-call-parser hermes``) or of
  flowlift's drop-in API writes;
* ``responses``: hosted MCP through flowlift's ``/v1/responses`` (one request a
  question, ``tools: [{"type": "mcp", "server_label": "docs", ...}]`` naming the proxy's
  ``[tools.docs]``): the proxy lists the tools, runs every call and loops
  (``max_tool_calls`` 5, so at most 6 model turns, the last one without tools);
* ``agents_sdk``: the same agent as an OpenAI Agents SDK ``Agent`` (its default
  Responses model, pointed at flowlift) with the two tools as function tools,
  ``Runner.run(max_turns=6)``;
* ``langgraph``: LangGraph's ``create_react_agent`` with ``FlowliftChat.bind_tools`` and
  a ``ToolNode`` (examples/agents/langgraph_react.py), at most 6 model turns.

A call is valid when its tool exists and its arguments are JSON that fit the tool's
schema (checked here for ``client`` and ``agents_sdk``; for ``responses`` an
``mcp_call`` without ``error``, for ``langgraph`` a parsed call whose ``ToolMessage`` is
not an error; the steps' from their trace). ``--smoke`` runs every variant on two
questions against a fake-engine proxy (:func:`scripted` plays the model) and writes
nothing: plumbing only (tests/project/test_bench_smoke.py).

    .venv/bin/python bench/agents_format.py --base-url http://127.0.0.1:8601 \\
        --model large --variants step proxy loop client --label native
    .venv/bin/python bench/agents_format.py --base-url http://127.0.0.1:8000/v1 \\
        --model /path/to/Qwen2.5-Coder-1.5B-Instruct --variants client --label vllm
    .venv/bin/python bench/agents_format.py --smoke

Writes ``bench/results/agents_format.<label>.json`` and prints one line per variant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agents import set_tracing_disabled

from bench.harness import proxy
from examples.agents import docs_tools, research
from flowlift.local_engine.base import GenerationRequest
from flowlift.sdk.agents import tool_spec
from flowlift.testing import tool_calls_text

MAX_TURNS = research.MAX_TURNS
HERE = Path(__file__).resolve().parent


@dataclass(slots=True)
class Row:
    """One question in one variant."""

    module: str
    correct: bool
    answer: str | None
    calls: int = 0
    valid_calls: int = 0
    ok_results: int = 0
    turns: int = 0
    max_turns_reached: bool = False
    error: str | None = None

    @property
    def after_tool(self) -> bool:
        """Answered (rightly) after at least one tool result came back."""
        return self.correct and self.ok_results > 0


def not_prose(answer: str | None) -> bool:
    """The "answer" is no answer a user could read: empty, tool-call or tool-result
    markup (``<tool_call>``, ``<tool_response>``), or a JSON object shaped like a call
    (``{"name": ..., "arguments": ...}``, fenced or not, braces doubled or not) -- the
    scoring still counts it right when it names the module (as the issue's baseline
    figure did)."""
    text = (answer or "").strip()
    if not text or "<tool_call>" in text or "<tool_response>" in text:
        return True
    body = re.sub(r"^```(?:json)?|```$", "", text).strip()
    return body.startswith("{") and '"name"' in body and '"arguments"' in body


def summary(rows: list[Row]) -> dict[str, Any]:
    """A variant's counts (the report's fields; ``right`` is the issue's scoring)."""
    return {"right": sum(r.correct for r in rows), "questions": len(rows),
            "right_after_a_tool_result": sum(r.after_tool for r in rows),
            "calls": sum(r.calls for r in rows),
            "valid_calls": sum(r.valid_calls for r in rows),
            "answered_at_max_turns": sum(r.max_turns_reached for r in rows),
            "failed": sum(r.error is not None for r in rows),
            "answers_not_prose": sum(r.error is None and not_prose(r.answer) for r in rows),
            "right_in_prose": sum(r.correct and not not_prose(r.answer) for r in rows)}


def _step_rows(wf: Any, outs: list[research.Outcome]) -> list[Row]:
    rows = []
    # step ids are <name>_<n>, numbered in the order the questions were asked
    by_question = sorted((r for r in wf.trace if r.get("type") == "step"),
                         key=lambda r: int(str(r["step_id"]).rsplit("_", 1)[1]))
    for out, rec in zip(outs, by_question, strict=False):
        calls = rec.get("tool_calls") or []
        rows.append(Row(out.question.module, out.correct, out.answer, len(calls),
                        sum(c.get("outcome") != "invalid" for c in calls),
                        sum(c.get("outcome") == "ok" for c in calls), out.turns,
                        bool(rec.get("max_turns_reached")), out.error))
    return rows


def _loop_rows(outs: list[research.Outcome]) -> list[Row]:
    """Each turn before the answer used a tool (the ``decide`` contract holds every
    JSON, so every call is valid)."""
    rows = []
    for out in outs:
        tools_used = out.turns - (1 if out.answer is not None else 0)
        rows.append(Row(out.question.module, out.correct, out.answer, tools_used,
                        tools_used, tools_used, out.turns, False, out.error))
    return rows


def _openai_tools() -> list[dict[str, Any]]:
    out = []
    for fn in (research.search, research.read):
        spec = tool_spec(fn)
        out.append({"type": "function", "function": {
            "name": spec.name, "description": spec.description,
            "parameters": spec.parameters}})
    return out


def _run_tool(name: str, arguments: str, tools: list[dict[str, Any]]) -> tuple[str, bool]:
    """(result text, the call was valid)."""
    spec = next((t["function"] for t in tools if t["function"]["name"] == name), None)
    if spec is None:
        return f"error: there is no tool {name!r}", False
    try:
        args = json.loads(arguments or "{}")
        jsonschema.validate(args, spec["parameters"])
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"error: bad arguments: {exc}", False
    fn = docs_tools.search if name == "search" else docs_tools.read
    return json.dumps(fn(**args), ensure_ascii=False), True


def _count(row: Row, valid: bool) -> None:
    """One tool call the model made (a valid one's result went back to it)."""
    row.calls += 1
    row.valid_calls += valid
    row.ok_results += valid


def _answered(row: Row, q: research.Question, text: str | None) -> Row:
    row.answer = text or ""
    row.correct = research.Outcome(q, answer=row.answer).correct
    return row


async def client_question(client: Any, model: str, q: research.Question) -> Row:
    """The plain client loop for one question."""
    tools = _openai_tools()
    messages: list[dict[str, Any]] = [{"role": "system", "content": research.SYSTEM},
                                      {"role": "user", "content": q.text}]
    row = Row(q.module, False, None)
    for turn in range(1, MAX_TURNS + 1):
        row.turns = turn
        resp = await client.chat.completions.create(
            model=model, messages=messages, tools=tools, temperature=0, max_tokens=128)
        msg = resp.choices[0].message
        if not msg.tool_calls:
            return _answered(row, q, msg.content)
        messages.append({"role": "assistant", "content": msg.content, "tool_calls": [
            c.model_dump() for c in msg.tool_calls]})
        for call in msg.tool_calls:
            text, ok = _run_tool(call.function.name, call.function.arguments, tools)
            _count(row, ok)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    row.error = f"no answer after {MAX_TURNS} turns"
    return row


HOSTED_DOCS = {"type": "mcp", "server_label": "docs", "allowed_tools": ["search", "read"],
               "require_approval": "never"}
"""The proxy's ``[tools.docs]`` (bench/agents_format.toml) as a hosted MCP tool."""


async def responses_question(client: Any, model: str, q: research.Question) -> Row:
    """Hosted MCP: one ``/v1/responses`` request; the proxy runs the loop."""
    resp = await client.responses.create(
        model=model, instructions=research.SYSTEM, input=q.text, tools=[HOSTED_DOCS],
        temperature=0, max_output_tokens=128, max_tool_calls=MAX_TURNS - 1)
    row = Row(q.module, False, None)
    for item in resp.output:
        if item.type == "mcp_call":
            _count(row, item.error is None)
    row.turns = row.calls + 1  # the model's turns when each made one call
    row.max_turns_reached = row.calls >= MAX_TURNS - 1
    return _answered(row, q, resp.output_text)


async def agents_sdk_question(client: Any, model: str, q: research.Question) -> Row:
    """An OpenAI Agents SDK agent (Responses model on flowlift) with function tools."""
    from agents import Agent, FunctionTool, ModelSettings, OpenAIResponsesModel, Runner
    from agents.exceptions import MaxTurnsExceeded

    row = Row(q.module, False, None)
    specs = _openai_tools()

    def function_tool(spec: dict[str, Any]) -> FunctionTool:
        async def invoke(_ctx: Any, arguments: str) -> str:
            text, ok = _run_tool(spec["name"], arguments, specs)
            _count(row, ok)
            return text
        return FunctionTool(name=spec["name"], description=spec["description"],
                            params_json_schema=spec["parameters"], on_invoke_tool=invoke,
                            strict_json_schema=False)

    agent = Agent(name="research", instructions=research.SYSTEM,
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(temperature=0.0, max_tokens=128),
                  tools=[function_tool(t["function"]) for t in specs])
    try:
        result = await Runner.run(agent, q.text, max_turns=MAX_TURNS)
    except MaxTurnsExceeded:
        row.turns, row.error = MAX_TURNS, f"no answer after {MAX_TURNS} turns"
        return row
    row.turns = len(result.raw_responses)
    return _answered(row, q, str(result.final_output))


async def langgraph_question(agent: Any, q: research.Question) -> Row:
    """LangGraph's react agent (examples/agents/langgraph_react.py) on one question."""
    from langchain_core.messages import AIMessage, ToolMessage
    from langgraph.errors import GraphRecursionError

    row = Row(q.module, False, None)
    try:
        state = await agent.ainvoke({"messages": [("user", q.text)]},
                                    {"recursion_limit": 2 * MAX_TURNS + 1})
    except GraphRecursionError:
        row.error = f"no answer after {MAX_TURNS} turns"
        return row
    messages = state["messages"]
    row.turns = sum(isinstance(m, AIMessage) for m in messages)
    for m in messages:
        if isinstance(m, AIMessage):
            row.calls += len(m.invalid_tool_calls)
        elif isinstance(m, ToolMessage):
            _count(row, m.status != "error")
    return _answered(row, q, str(messages[-1].content))


CLIENT_VARIANTS = {"client": client_question, "responses": responses_question,
                   "agents_sdk": agents_sdk_question}
"""Variants that ask each question through an OpenAI client of the proxy."""
VARIANTS = ("step", "proxy", "loop", *CLIENT_VARIANTS, "langgraph")


async def run_variant(name: str, base_url: str, model: str,
                      questions: list[research.Question]) -> list[Row]:
    root = base_url.rstrip("/").removesuffix("/v1")
    if name in CLIENT_VARIANTS:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=f"{root}/v1", api_key="none", timeout=1800,
                             max_retries=0)
        ask = CLIENT_VARIANTS[name]
        return list(await asyncio.gather(*(ask(client, model, q) for q in questions)))
    if name == "langgraph":
        from examples.agents import langgraph_react

        agent = langgraph_react.build_agent(model, root)
        return list(await asyncio.gather(*(langgraph_question(agent, q)
                                           for q in questions)))
    research.research.model = research.research_on_proxy.model = model
    research.decide.model = model
    if name == "loop":
        _, outs = await research.run_loop_variant(questions, root)
        return _loop_rows(outs)
    wf, outs = await research.run_step_variant(questions, root, on_proxy=name == "proxy")
    return _step_rows(wf, outs)


def scripted(request: GenerationRequest) -> str:
    """``--smoke``'s FakeEngine responder: a turn with tools searches once, then answers
    with the first module the search returned; the explicit loop's ``decide`` does the
    same in its JSON contract."""
    messages = list(request.messages or ())
    called = any(m.role == "assistant" for m in messages)  # a tool result came back
    searched = "found so far" in messages[-1].content  # ``decide``'s notes
    found = re.findall(r"""\[[\[(]["']([a-z_]+)""", messages[-1].content)
    answer = f"The {found[0] if found else 'csv'} module."
    schema = request.constraint.json_schema if request.constraint is not None else None
    if schema is not None and "tool_calls" not in json.dumps(schema):  # ``decide``
        return json.dumps({"tool": "answer", "input": answer} if searched
                          else {"tool": "search", "input": "comma separated values"})
    offers_tools = bool(request.tools) or schema is not None  # native or constrained
    if offers_tools and not called:
        return tool_calls_text(("search", {"query": "comma separated values"}))
    return json.dumps({"content": answer}) if schema is not None else answer


@contextlib.contextmanager
def smoke_proxy() -> Iterator[str]:
    """A fake-engine proxy serving ``large`` (:func:`scripted`) with
    bench/agents_format.toml's ``[tools.docs]``."""
    tools = HERE.joinpath("agents_format.toml").read_text().split("[tools.docs]", 1)[1]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "agents_format_smoke.toml"
        cfg.write_text(f"[tools.docs]{tools}", encoding="utf-8")
        with proxy("--config", str(cfg), "--model", "large", "--fake-responder",
                   "bench.agents_format:scripted", name="agents_format",
                   engine="fake") as base:
            yield base


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen variant, one after the other; each one's line printed (and the
    results so far saved, unless ``--smoke``) as it ends."""
    docs_tools.corpus_index()
    set_tracing_disabled(True)  # the Agents SDK exports no traces (no network)
    questions = list(research.QUESTIONS[:args.limit])
    results: dict[str, Any] = {"label": args.label, "model": args.model,
                               "base_url": args.base_url, "variants": {}}
    for name in args.variants:
        started = time.perf_counter()
        try:
            rows = await run_variant(name, args.base_url, args.model, questions)
        except Exception as exc:  # reported, and the next variant runs
            print(f"{args.label} {name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            results["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        wall = time.perf_counter() - started
        results["variants"][name] = {**summary(rows), "wall_s": round(wall, 1),
                                     "rows": [asdict(r) for r in rows]}
        s = results["variants"][name]
        print(f"{args.label} {name}: {s['right']}/{s['questions']} right, "
              f"{s['right_after_a_tool_result']} after a tool result; calls "
              f"{s['valid_calls']}/{s['calls']} valid; answered at max_turns "
              f"{s['answered_at_max_turns']}; failed {s['failed']}; not prose "
              f"{s['answers_not_prose']} (right in prose {s['right_in_prose']}); "
              f"{wall:.0f} s",
              flush=True)
        if not args.smoke:
            save(results)
    return results


def save(results: dict[str, Any]) -> None:
    """Write the results so far (each variant as it ends)."""
    out = HERE / "results" / f"agents_format.{results['label']}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--model", default="large")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--label", default="run")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="every variant, 2 questions, a fake-engine proxy; no file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.limit, args.label = 2, "smoke"
        with smoke_proxy() as args.base_url:
            results = asyncio.run(run_all(args))
        failed = [n for n, v in results["variants"].items()
                  if "error" in v or v["failed"] or not v["calls"]]
        print(f"smoke: variants that failed or made no call: {failed or 'none'}")
        return 1 if failed else 0
    if args.base_url is None:
        parser.error("--base-url is required (or --smoke)")
    asyncio.run(run_all(args))
    print(f"wrote bench/results/agents_format.{args.label}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
