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
  flowlift's drop-in API writes.

    .venv/bin/python bench/agents_format.py --base-url http://127.0.0.1:8601 \\
        --model large --variants step proxy loop client --label native
    .venv/bin/python bench/agents_format.py --base-url http://127.0.0.1:8000/v1 \\
        --model /path/to/Qwen2.5-Coder-1.5B-Instruct --variants client --label vllm

Writes ``bench/results/agents_format.<label>.json`` and prints one line per variant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.agents import docs_tools, research
from flowlift.sdk.agents import tool_spec

MAX_TURNS = research.MAX_TURNS


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


def summary(rows: list[Row]) -> dict[str, Any]:
    return {"right": sum(r.correct for r in rows), "questions": len(rows),
            "right_after_a_tool_result": sum(r.after_tool for r in rows),
            "calls": sum(r.calls for r in rows),
            "valid_calls": sum(r.valid_calls for r in rows),
            "answered_at_max_turns": sum(r.max_turns_reached for r in rows),
            "failed": sum(r.error is not None for r in rows)}


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
            row.answer = msg.content or ""
            row.correct = research.Outcome(q, answer=row.answer).correct
            return row
        messages.append({"role": "assistant", "content": msg.content, "tool_calls": [
            c.model_dump() for c in msg.tool_calls]})
        for call in msg.tool_calls:
            row.calls += 1
            text, ok = _run_tool(call.function.name, call.function.arguments, tools)
            row.valid_calls += ok
            row.ok_results += ok
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    row.error = f"no answer after {MAX_TURNS} turns"
    return row


async def run_variant(name: str, base_url: str, model: str,
                      questions: list[research.Question]) -> list[Row]:
    if name == "client":
        from openai import AsyncOpenAI

        url = base_url if base_url.rstrip("/").endswith("/v1") else f"{base_url}/v1"
        client = AsyncOpenAI(base_url=url, api_key="none", timeout=1800)
        return list(await asyncio.gather(*(client_question(client, model, q)
                                           for q in questions)))
    research.research.model = research.research_on_proxy.model = model
    research.decide.model = model
    if name == "loop":
        _, outs = await research.run_loop_variant(questions, base_url)
        return _loop_rows(outs)
    wf, outs = await research.run_step_variant(questions, base_url,
                                               on_proxy=name == "proxy")
    return _step_rows(wf, outs)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    docs_tools.corpus_index()
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
              f"{s['answered_at_max_turns']}; failed {s['failed']}; {wall:.0f} s",
              flush=True)
        save(results)
    return results


def save(results: dict[str, Any]) -> None:
    """Write the results so far (each variant as it ends)."""
    out = Path(__file__).resolve().parent / "results" / f"agents_format.{results['label']}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--variants", nargs="+", default=["step", "proxy", "loop", "client"],
                        choices=["step", "proxy", "loop", "client"])
    parser.add_argument("--label", default="run")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    asyncio.run(main_async(args))
    print(f"wrote bench/results/agents_format.{args.label}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
