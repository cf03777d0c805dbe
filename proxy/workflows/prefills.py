"""A run's prefill-ahead: while a tool is out, the known start of the steps that read
its output is prefilled on their engine (what to prefill: the pure
:mod:`flowlift.proxy.workflows.ahead`; whether the engine has room:
:class:`~flowlift.proxy.dispatch.slots.prefill_ahead.PrefillAhead`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flowlift.compiler import Plan
from flowlift.errors import FlowliftError
from flowlift.graph import LLMNode, Node
from flowlift.local_engine.base import ChatMessage
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.tenants import RunKey
from flowlift.proxy.workflows.ahead import HOLE, ahead_request, consumers, known_prefix


class RunPrefills:
    """The prefill-aheads one run asks for.

    Args:
        backends: where the steps' models are served.
        key: the run's store key (the aheads' request ids and session).
        run_id: the run's id (the program whose KV an engine keeps for its next turn).
    """

    def __init__(self, backends: Backends, key: RunKey, run_id: str) -> None:
        self.backends = backends
        self.key = key
        self.run_id = run_id
        self.asked = 0  # prefill-aheads asked for (numbers their request ids)

    def after_tool(self, readers: Iterable[Node], nodes: Mapping[str, Node],
                   plan: Plan | None, outputs: Mapping[str, Any],
                   ended: Callable[[str], bool]) -> None:
        """While a tool is out: prefill the known start of each model step among
        ``readers`` (the steps reading its output) that has not ended."""
        skip = plan.merged_into if plan else {}
        for step in consumers(readers, nodes, skip):
            if ended(step.id):
                continue
            messages = known_prefix(step.messages, outputs)
            if messages is not None:
                self.ahead(step, step.models()[0], messages)

    def ahead(self, node: LLMNode, want: str | None, messages: Sequence[ChatMessage]) -> None:
        """Prefill ``messages`` (ending in :data:`~.ahead.HOLE`) of ``node`` on ``want``
        ahead of its request (a model that does not resolve: nothing)."""
        try:
            model, _ = self.backends.resolve(want)
        except FlowliftError:
            return
        local = self.backends.local_of(model)
        if local is not None:  # the next turn is known to come: keep this run's KV
            # (under the program key its calls are scheduled by: the tenant's run key)
            local.backend.slots.programs.keep(self.key)
        self.asked += 1
        request = ahead_request(node, model, messages, f"{self.key}:{node.id}:{self.asked}",
                                self.key)
        self.backends.ahead.issue(request, HOLE)
