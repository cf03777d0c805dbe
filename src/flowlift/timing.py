"""What a step costs in time, for the compiler: one model call, an agent step's turns,
and the :class:`~flowlift.simulate.Work` it asks of its engine. Pure code.

An agent step (an llm step with ``tools``) is a loop of model turns with tool calls in
between, not one call (issue 38 item 8: an agent step was planned as one call). It is
planned as :func:`agent_turns` turns: the first prefills the step's prompt, each later
one only what the conversation grew by since (the previous turn's output and the tool
results, the rest being in the engine's prefix cache: the proxy keeps an agent's turns
on one replica), and a tool call's time (``tool_ms``) lies between two turns.
"""

from __future__ import annotations

import math

from flowlift.costs import CostModel
from flowlift.graph import LLMNode
from flowlift.simulate import Work

TOOL_RESULT_TOKENS = 32.0
"""Tokens a tool call and its result add to an agent's conversation (as a client-run
tool step's output is counted)."""


def agent_turns(node: LLMNode, learned: float | None = None) -> float:
    """The model turns an agent step is planned at.

    ``tool_choice="required"``: every turn calls a tool, so the loop runs ``max_turns``
    turns. Else the turns the step took on average in finished runs (``learned``, per
    step name and model: :meth:`flowlift.proxy.store.outcomes.StepOutcomes.turns`), at
    most ``max_turns``; with none learned, ``sqrt(max_turns)``: the geometric mean of
    the fewest (1: it answers at once) and the most, the guess whose worst ratio to the
    true count is smallest (``max_turns=10``: 3.2 turns, at most 3.2x off either way).
    A step without tools: 1.
    """
    if not node.tools:
        return 1.0
    if node.tool_choice == "required":
        return float(node.max_turns)
    if learned is not None and learned > 0:
        return min(max(learned, 1.0), float(node.max_turns))
    return math.sqrt(node.max_turns)


def call_ms(cost: CostModel, uncached: float, out: float, turns: float = 1.0,
            tool_ms: float = 0.0) -> float:
    """ms of a model step of ``turns`` turns with the engine to itself: the first turn
    prefills ``uncached`` prompt tokens, each later one the previous output and
    :data:`TOOL_RESULT_TOKENS` after ``tool_ms`` of tool call; each turn decodes
    ``out`` tokens (:meth:`~flowlift.costs.CostModel.step_ms`)."""
    first = cost.step_ms(uncached, out)
    later = max(turns - 1.0, 0.0)
    return first + later * (tool_ms + cost.step_ms(out + TOOL_RESULT_TOKENS, out))


def call_work(cost: CostModel, engine: str, uncached: float, out: float, turns: float,
              tool_ms: float, scale: float = 1.0) -> Work:
    """The :class:`Work` of :func:`call_ms`'s step on ``engine``, ``scale`` times over
    (a cascade's or a retried step's expected attempts). The time to first token besides
    prefill is off the engine, less the fixed part of the engine step its first token
    takes (so a step alone on its engine takes :func:`call_ms`)."""
    later = max(turns - 1.0, 0.0)
    base = cost.tpot_ms - min(max(cost.per_request_ms, 0.0), cost.tpot_ms)
    return Work(engine=engine,
                fixed_ms=max(scale * (turns * cost.ttft_overhead_ms + later * tool_ms)
                             - base, 0.0),
                prefill_tokens=scale * (uncached + later * (out + TOOL_RESULT_TOKENS)),
                decode_tokens=scale * turns * max(out - 1.0, 0.0))


__all__ = ["TOOL_RESULT_TOKENS", "agent_turns", "call_ms", "call_work"]
