"""The engine request of one try of a run's LLM step: pure construction, no I/O.

The request id is ``<run key>:<step id>:<try>``; the run key is the session (KV-cache
affinity across the run's steps, :mod:`flowlift.proxy.sessions`) and the program of
program-level scheduling. An agent step's turns (an llm step with ``tools``) also name
the step (``agent_id``): its own conversation is a sub-session whose parent is the run,
for the routers that know parents (vllm-router's ``parent_program_id``, Dynamo's
``X-Dynamo-Parent-Session-ID``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowlift.graph import LLMNode
from flowlift.local_engine.base import (
    ChatMessage,
    GenerationRequest,
    OutputConstraint,
    SamplingOptions,
    ToolDef,
)
from flowlift.proxy.dispatch.slots.scheduler import Priority
from flowlift.proxy.tenants import RunKey


@dataclass(frozen=True)
class StepRequests:
    """Builds the engine requests of one run's steps.

    Attributes:
        key: the run's store key (request ids, session, program).
        fcfs: first-come-first-served scheduling: every request at engine priority 0.
    """

    key: RunKey
    fcfs: bool = False

    def build(self, node: LLMNode, model: str, messages: Sequence[ChatMessage], number: int,
              *, logprobs: bool, priority: Priority, max_tokens: int | None = None,
              service_tier: str | None = None,
              expected_output_tokens: int | None = None) -> GenerationRequest:
        """Try ``number`` of ``node`` on ``model``; ``max_tokens`` overrides the step's (a
        retry after a cut-off output); ``service_tier``: the tier the run's plan chose
        (None: the default); ``expected_output_tokens``: the plan's output length, for
        the engines' hints."""
        p = node.params
        contract = node.contract
        return GenerationRequest(
            request_id=f"{self.key}:{node.id}:{number}",  # run:step:attempt
            model=model, messages=messages,
            sampling=SamplingOptions(max_tokens=max_tokens or p.max_tokens,
                                     temperature=p.temperature,
                                     top_p=p.top_p, stop=p.stop, seed=p.seed,
                                     logprobs=0 if logprobs else None),
            constraint=(OutputConstraint(json_schema=contract.json_schema,
                                         choices=contract.choices, regex=contract.regex)
                        if contract else None),
            session_id=self.key,
            priority=0 if self.fcfs else priority.engine_priority(),
            tools=tuple(ToolDef(t.name, t.description, t.parameters) for t in node.tools or ()),
            service_tier=service_tier,
            tool_choice=node.tool_choice, parallel_tool_calls=node.parallel_tool_calls,
            expected_output_tokens=expected_output_tokens,
            agent_id=node.id if node.tools else None)
