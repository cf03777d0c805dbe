"""A LangGraph graph whose LLM calls are one flowlift run.

A support-ticket triage graph: ``classify`` labels the ticket (``bug`` or ``question``,
a constrained choice); a conditional edge reads the label and fans out to ``diagnose``
and ``draft`` for a bug (``draft`` alone for a question); ``summarize`` joins them.
Every node calls :class:`flowlift.sdk.langchain.FlowliftChat`, a LangChain chat model
that records the call as a step of the current ``workflow(...)`` run and answers with
the step's Semantic Variable marker at once. So LangGraph walks its supersteps without
waiting, the router's :func:`~flowlift.sdk.langchain.areveal` is the only read (the run
opens there), and the proxy runs ``diagnose`` and ``draft`` side by side and
``summarize`` once both are done, in dataflow order.

Run it through the proxy (one is started for you when none answers)::

    flowlift run examples/frameworks/langgraph_graph.py [--ticket TEXT]
    flowlift run --engine fake examples/frameworks/langgraph_graph.py   # without a model

It prints each step's output, the run's steps with their start and end on the proxy
(milliseconds from the first start) and dependencies, whether the fan-out's two calls
overlapped, the run id and the stage split. Exit status: 0, or 2 when no proxy could
be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict

if __package__ in (None, ""):  # run as a script: make `examples.frameworks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph

from flowlift import FlowliftError, ProxyUnavailable, Workflow, workflow
from flowlift.sdk.langchain import FlowliftChat, areveal, reveal_state

TICKET = ("Since upgrading to version 2.3 the export button writes an empty CSV file "
          "for reports with more than 10,000 rows; smaller reports export fine.")
SYSTEM = "You are a support engineer. Be brief and concrete."
FAN_OUT = ("diagnose", "draft")


class Triage(TypedDict, total=False):
    """The graph's state: the ticket and each node's answer (markers while recording)."""

    ticket: str
    label: str
    diagnosis: str
    reply: str
    summary: str
    visited: Annotated[list[str], operator.add]


def build_graph(model: str | None = None, max_tokens: int = 96
                ) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The triage graph; its nodes' calls go to ``model`` (None: the proxy's default)."""
    labeller = FlowliftChat(model=model, max_tokens=4, output=Literal["bug", "question"])
    writer = FlowliftChat(model=model, max_tokens=max_tokens)

    async def classify(state: Triage) -> Triage:
        answer = await labeller.ainvoke([
            SystemMessage(SYSTEM),
            HumanMessage(f"Ticket: {state['ticket']}\nIs this a bug or a question?")])
        return {"label": str(answer.content), "visited": ["classify"]}

    async def route(state: Triage) -> list[str]:
        label = await areveal(state["label"])  # the one read: ships classify, waits
        return list(FAN_OUT) if label == "bug" else ["draft"]

    async def diagnose(state: Triage) -> Triage:
        answer = await writer.ainvoke([
            SystemMessage(SYSTEM),
            HumanMessage(f"Ticket: {state['ticket']}\nList the two most likely causes.")])
        return {"diagnosis": str(answer.content), "visited": ["diagnose"]}

    async def draft(state: Triage) -> Triage:
        answer = await writer.ainvoke([
            SystemMessage(SYSTEM),
            HumanMessage(f"Ticket: {state['ticket']}\nCategory: {state['label']}\n"
                         "Write a two-sentence reply to the customer.")])
        return {"reply": str(answer.content), "visited": ["draft"]}

    async def summarize(state: Triage) -> Triage:
        answer = await writer.ainvoke([
            SystemMessage(SYSTEM),
            HumanMessage(f"Causes: {state.get('diagnosis', 'not investigated')}\n"
                         f"Reply sent: {state['reply']}\nSummarize the ticket's handling "
                         "in one sentence.")])
        return {"summary": str(answer.content), "visited": ["summarize"]}

    graph = StateGraph(Triage)
    for node in (classify, diagnose, draft, summarize):
        graph.add_node(node.__name__, node)
    graph.add_edge(START, "classify")
    graph.add_conditional_edges("classify", route, list(FAN_OUT))
    graph.add_edge("diagnose", "summarize")
    graph.add_edge("draft", "summarize")
    graph.add_edge("summarize", END)
    return graph.compile()


async def triage(ticket: str, *, model: str | None = None,
                 trace_path: str | None = None) -> tuple[dict[str, Any], Workflow]:
    """Run the graph on ``ticket`` as one flowlift run.

    Returns:
        The final state with every marker replaced by its step's output, and the
        finished workflow (``wf.trace``, ``wf.run_id``).

    Raises:
        FlowliftError: the run failed (``WorkflowFailed``) or no proxy answered.
    """
    graph = build_graph(model)
    async with workflow("langgraph-triage", trace_path=trace_path) as wf:
        state = await graph.ainvoke({"ticket": ticket, "visited": []})
    return reveal_state(state, wf), wf


def step_spans(wf: Workflow) -> dict[str, tuple[float, float]]:
    """``{step_id: (started_ms, finished_ms)}`` of a finished run, from its trace (the
    proxy's clock)."""
    return {r["step_id"]: (r["started_ms"], r["finished_ms"]) for r in wf.trace
            if r.get("type") == "step"}


def overlap_ms(spans: dict[str, tuple[float, float]], a: str, b: str) -> float:
    """How long steps ``a`` and ``b`` ran at the same time on the proxy (0: never)."""
    (s1, e1), (s2, e2) = spans[a], spans[b]
    return max(0.0, min(e1, e2) - max(s1, s2))


def _print(state: dict[str, Any], wf: Workflow) -> None:
    print(f"visited: {' -> '.join(state['visited'])}")
    for key in ("label", "diagnosis", "reply", "summary"):
        if key in state:
            print(f"{key:>9}: {' '.join(str(state[key]).split())[:160]}")
    spans = step_spans(wf)
    first = min(s for s, _ in spans.values())
    deps = {n.id: sorted({p.ref for m in getattr(n, "messages", ()) for p in m.content
                          if hasattr(p, "ref")}) for n in wf.nodes}
    print(f"\nrun {wf.run_id}: steps on the proxy (ms from the first start)")
    for sid, (s, e) in sorted(spans.items(), key=lambda kv: kv[1]):
        print(f"  {sid:<12} {s - first:8.1f} .. {e - first:8.1f}   after {deps.get(sid) or '-'}")
    ids = {sid.rsplit("_", 1)[0]: sid for sid in spans}
    if all(n in ids for n in FAN_OUT):
        both = overlap_ms(spans, ids[FAN_OUT[0]], ids[FAN_OUT[1]])
        print(f"fan-out {FAN_OUT[0]} | {FAN_OUT[1]}: ran side by side for {both:.1f} ms")
    print(wf.report())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--ticket", default=TICKET)
    parser.add_argument("--model", default=None, help="served model (default: the proxy's)")
    parser.add_argument("--trace", default="runs/langgraph-triage.jsonl",
                        help="write the run's trace here")
    args = parser.parse_args(argv)
    try:
        state, wf = asyncio.run(triage(args.ticket, model=args.model, trace_path=args.trace))
    except ProxyUnavailable as exc:
        print(f"no proxy: {exc}", file=sys.stderr)
        return 2
    except FlowliftError as exc:
        print(f"the run failed: {exc}", file=sys.stderr)
        return 1
    _print(state, wf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
