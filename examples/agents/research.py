"""A research agent over the standard library's docstrings, written two ways.

Twelve questions whose answers are in the ``stdlib_docs`` corpus (42 module docstrings,
searched with its BM25 index), answered by a model that may call two tools:
``search(query)`` (the best modules with their first sentence) and ``read(module)`` (a
module's documentation). Both variants run every question at once, in one run each
(one run id, one trace):

* **agent step**: ``@step(tools=[search, read], max_turns=N)``; the proxy runs the
  loop (model turn -> the app runs the calls -> results back into the conversation).
* **explicit loop**: the same agent as Python in an open run (``async with workflow``):
  a ``decide`` step with a JSON contract (``{"tool": "search"|"read"|"answer",
  "input": ...}``) is awaited, the app looks at the decision, records the tool call as
  a ``@tool`` step whose output feeds the next ``decide``, and loops.
* **tools on the proxy** (``--variant proxy``): the agent step with
  ``tools=[proxy_tool("docs.search"), proxy_tool("docs.read")]``; the proxy runs the
  same two functions itself (``[tools.docs]`` of examples/agents/proxy_tools.toml:
  configured callables, or the MCP server examples/agents/docs_mcp.py), so no turn
  waits for the app.

Run it through the proxy (one is started for you when none answers)::

    flowlift run --config examples/stdlib_docs/flowlift.toml examples/agents/research.py \
        [--variant step|loop|both] [--limit N] [--model NAME]
    flowlift run --engine fake examples/agents/research.py    # without a model
    flowlift run --config examples/agents/proxy_tools.toml \
        examples/agents/research.py --variant proxy            # tools on the proxy

With that config both agents run on ``large`` (Qwen2.5-Coder-1.5B-Instruct); without it,
on the proxy's default model. It prints, per variant, each question's answer, whether it
names the expected module, how many of the model's tool calls were valid, the model
turns it took (or why it failed: ``max_turns`` reached, a broken contract),
then the run's stage split (``wf.report()``), run id and trace file. A question that
fails is reported on its row; the example still runs to the end. Exit status: 0, or 2
when no proxy could be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

if __package__ in (None, ""):  # run as a script: make `examples.agents` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.agents import docs_tools
from flowlift import (
    FlowliftError,
    ProxyUnavailable,
    WorkflowFailed,
    proxy_tool,
    step,
    tool,
    workflow,
)
from flowlift.sdk.workflow import DEFAULT_BASE_URL

MAX_TURNS = 6


DEFAULT_MODEL = "large"
"""The stdlib_docs config's larger model (Qwen2.5-Coder-1.5B-Instruct there)."""


def agent_model(base_url: str) -> str | None:
    """:data:`DEFAULT_MODEL` when the proxy at ``base_url`` serves it, else None (the
    proxy's default model)."""
    try:
        listed = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None  # the workflow itself reports an unreachable proxy
    served = {m.get("id") for m in listed.get("data", [])}
    return DEFAULT_MODEL if DEFAULT_MODEL in served else None


@dataclass(frozen=True, slots=True)
class Question:
    """A question and the module whose docstring answers it."""

    text: str
    module: str


QUESTIONS: tuple[Question, ...] = (
    Question("Which module reads and writes comma separated value files?", "csv"),
    Question("Which module compresses data with the library that is based on GNU zip "
             "and computes Adler-32 checksums?", "zlib"),
    Question("Which module offers regular expression matching similar to Perl's?", "re"),
    Question("Which module spawns processes and connects to their input, output and "
             "error pipes?", "subprocess"),
    Question("Which module creates temporary files and directories?", "tempfile"),
    Question("Which module implements the heap queue algorithm, also known as a "
             "priority queue?", "heapq"),
    Question("Which module converts between Python values and C structs?", "struct"),
    Question("Which module measures the execution time of small code snippets?", "timeit"),
    Question("Which module makes UUID objects according to RFC 4122?", "uuid"),
    Question("Which module is an SMTP client?", "smtplib"),
    Question("Which module converts colors between RGB and other color systems?",
             "colorsys"),
    Question("Which module matches filenames with shell patterns?", "fnmatch"),
)


@tool
def search(query: docs_tools.Query) -> list[tuple[str, str]]:
    """Search the Python standard library's module documentation. Returns the 3 best
    matching modules as [module name, its first sentence] pairs."""
    return docs_tools.search(query)


@tool
def read(module: docs_tools.ModuleName) -> str:
    """Read the documentation of one module, by the name search returned."""
    return docs_tools.read(module)


corpus, corpus_index = docs_tools.corpus, docs_tools.corpus_index


SYSTEM = ("You answer questions about the Python standard library from its documentation. "
          "Search the documentation, read a module when you are unsure, then answer with "
          "the module's name and a short reason.")


@step(tools=[search, read], max_turns=MAX_TURNS, max_tokens=128)
def research(question: str) -> list[dict[str, str]]:
    """The agent step: the proxy loops over the model's tool calls."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@step(tools=[proxy_tool("docs.search"), proxy_tool("docs.read")], max_turns=MAX_TURNS,
      max_tokens=128)
def research_on_proxy(question: str) -> list[dict[str, str]]:
    """The agent step with the tools on the proxy (``[tools.docs]`` of
    examples/agents/proxy_tools.toml): no app round trip per turn."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


class Action(BaseModel):
    """What the explicit loop's model decides each turn."""

    tool: Literal["search", "read", "answer"]
    input: str = Field(min_length=1, max_length=100)


LOOP_SYSTEM = (f"{SYSTEM} Each turn reply with one JSON object: "
               '{"tool": "search", "input": <query>} to search, '
               '{"tool": "read", "input": <module name>} to read a module, or '
               '{"tool": "answer", "input": <module name and reason>} to answer.')


@step(output=Action, max_tokens=128, retries=1)
def decide(question: str, notes: str) -> list[dict[str, str]]:
    """One turn of the explicit loop: the question and what the tools returned so far."""
    user = question if not notes else f"{question}\n\nWhat you found so far:\n{notes}"
    return [{"role": "system", "content": LOOP_SYSTEM}, {"role": "user", "content": user}]


@dataclass(slots=True)
class Outcome:
    """One question's result in one variant."""

    question: Question
    answer: str | None = None
    turns: int = 0
    error: str | None = None

    @property
    def correct(self) -> bool:
        """The answer names the expected module (as a whole word)."""
        return self.answer is not None and re.search(
            rf"(?<![\w.]){re.escape(self.question.module)}(?![\w])", self.answer) is not None


async def loop_agent(out: Outcome) -> Outcome:
    """The agent as an explicit loop: await ``decide``, run the tool it asks for, loop;
    fills ``out`` (its turns so far stay counted when a step fails).

    Each tool call is a ``@tool`` step of the run; its output goes into the next turn's
    prompt as a reference, so it ships and runs with that turn (one flush per turn)."""
    notes: list[str] = []
    action = None
    for turn in range(1, MAX_TURNS + 1):
        out.turns = turn
        action = await decide(out.question.text, "\n".join(notes))
        if action.tool == "answer":
            out.answer = action.input
            return out
        result = search(action.input) if action.tool == "search" else read(action.input)
        notes.append(f"{action.tool}({action.input!r}) returned: {result}")
    last = action.tool if action is not None else "none"
    out.error = (f"no answer after {MAX_TURNS} turns (max_turns={MAX_TURNS}): every turn "
                 f"called tools; the last tool asked for was {last!r}")
    return out


async def guarded(question: Question) -> Outcome:
    """:func:`loop_agent`, with a failed step reported on the question's row."""
    out = Outcome(question)
    try:
        return await loop_agent(out)
    except FlowliftError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out


def _step_outcomes(wf: Any, vars_: list[Any], questions: list[Question]) -> list[Outcome]:
    outs = []
    for q, var in zip(questions, vars_, strict=True):
        record = next((r for r in wf.trace if r.get("step_id") == var.step_id), {})
        turns = max((a.get("turn") or 0 for a in record.get("attempts", ())), default=0)
        out = Outcome(q, turns=turns)
        try:
            out.answer = str(var.value)
        except FlowliftError as exc:
            out.error = str(wf.failures.get(var.step_id) or exc)
        outs.append(out)
    return outs


async def run_step_variant(questions: list[Question], base_url: str | None = None,
                           trace_path: str | None = None, *, on_proxy: bool = False,
                           ) -> tuple[Any, list[Outcome]]:
    """Every question as an agent step, in one run (``on_proxy``: the tools run on the
    proxy). Returns the workflow and outcomes."""
    vars_: list[Any] = []
    agent, name = (research_on_proxy, "proxy") if on_proxy else (research, "step")
    try:
        async with workflow(f"agents-{name}", base_url=base_url, trace_path=trace_path,
                            metadata={"example": "agents", "variant": name}) as wf:
            vars_ = [agent(q.text) for q in questions]
    except WorkflowFailed:
        pass  # failed questions are reported on their rows
    return wf, _step_outcomes(wf, vars_, questions)


async def run_loop_variant(questions: list[Question], base_url: str | None = None,
                           trace_path: str | None = None) -> tuple[Any, list[Outcome]]:
    """Every question as an explicit loop, all loops in one open run."""
    outs: list[Outcome] = []
    try:
        async with workflow("agents-loop", base_url=base_url, trace_path=trace_path,
                            metadata={"example": "agents", "variant": "loop"}) as wf:
            outs = list(await asyncio.gather(*(guarded(q) for q in questions)))
    except WorkflowFailed:
        pass  # failed questions are reported on their rows
    return wf, outs


def _cut(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def table(outs: list[Outcome]) -> str:
    """One row per question: expected module, ok/no, turns, answer or failure."""
    lines = [f"  {'#':>2}  {'expected':<10} {'ok':<3} {'turns':>5}  answer"]
    for i, o in enumerate(outs, 1):
        shown = o.answer if o.error is None else f"FAILED: {o.error}"
        lines.append(f"  {i:>2}  {o.question.module:<10} {'yes' if o.correct else 'no':<3} "
                     f"{o.turns:>5}  {_cut(shown or '', 110)}")
    return "\n".join(lines)


def tool_call_validity(trace: list[dict[str, Any]]) -> tuple[int, int]:
    """(valid, all) tool calls the model asked for in a run: an agent step's calls whose
    tool exists and whose arguments fit its schema (outcome not ``invalid``), plus the
    explicit loop's ``decide`` turns whose JSON held its contract."""
    valid = total = 0
    for record in trace:
        if record.get("type") != "step":
            continue
        for call in record.get("tool_calls") or ():
            total += 1
            valid += call.get("outcome") != "invalid"
        if record.get("name") == "decide":
            for attempt in record.get("attempts") or ():
                total += 1
                valid += attempt.get("outcome") == "ok"
    return valid, total


def print_variant(title: str, wf: Any, outs: list[Outcome]) -> None:
    right = sum(o.correct for o in outs)
    failed = sum(o.error is not None for o in outs)
    valid, calls = tool_call_validity(wf.trace)
    print(f"== {title} ==")
    print(table(outs))
    print(f"{right}/{len(outs)} answers name the expected module; {failed} failed; "
          f"turns: {sum(o.turns for o in outs)} in all; valid tool calls: {valid}/{calls}")
    print(wf.report())
    print(f"run id: {wf.run_id} ({wf.status}); trace: {wf.trace_path}")
    print()


async def run(variants: list[str], questions: list[Question], base_url: str | None = None,
              trace_dir: str = "runs") -> dict[str, list[Outcome]]:
    """Run the chosen variants one after the other and print each."""
    corpus_index()  # built now, not inside the first tool call
    results: dict[str, list[Outcome]] = {}
    runners = {"step": ("agent step (@step(tools=[search, read], max_turns="
                        f"{MAX_TURNS}))", run_step_variant),
               "loop": ("explicit loop (await decide(...) in an open run)", run_loop_variant),
               "proxy": ("agent step, tools on the proxy (proxy_tool(\"docs.search\"), "
                         "proxy_tool(\"docs.read\"))",
                         functools.partial(run_step_variant, on_proxy=True))}
    for name in variants:
        title, runner = runners[name]
        wf, outs = await runner(questions, base_url, f"{trace_dir}/agents.{name}.trace.jsonl")
        print_variant(title, wf, outs)
        results[name] = outs
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--variant", choices=("step", "loop", "both", "proxy"),
                        default="both",
                        help="both: step and loop; proxy: the agent step with its tools "
                             "run by the proxy (needs --config "
                             "examples/agents/proxy_tools.toml on `flowlift run`)")
    parser.add_argument("--limit", type=int, default=None,
                        help=f"only the first N of the {len(QUESTIONS)} questions")
    parser.add_argument("--trace-dir", default="runs",
                        help="write each run's trace here (default runs/)")
    parser.add_argument("--model", default=None,
                        help=f"the model both agents run on (default: {DEFAULT_MODEL!r} "
                             "when the proxy serves it, as with --config "
                             "examples/stdlib_docs/flowlift.toml; else the proxy's default)")
    args = parser.parse_args(argv)
    model = args.model or agent_model(os.environ.get("FLOWLIFT_BASE_URL", DEFAULT_BASE_URL))
    research.model = decide.model = model
    questions = list(QUESTIONS[:args.limit])
    variants = ["step", "loop"] if args.variant == "both" else [args.variant]
    print(f"agents: {len(questions)} questions over {len(corpus())} stdlib module "
          f"docstrings; tools search(query) and read(module); max_turns {MAX_TURNS}; "
          f"model {model or '(the proxy default)'}")
    print()
    try:
        asyncio.run(run(variants, questions, trace_dir=args.trace_dir))
    except ProxyUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
