"""How long a run waits for the app's result of a ``@tool`` step (issue 38, item 6).

The rule: the run's deadline clock stops while the app has the ball, but never past the
tool's ``timeout_s`` (``@tool(timeout_s=...)``), or, without one, past the run's
``deadline_s`` itself (a tool alone cannot outlast the whole run's budget); with neither
the wait is unbounded, as before. A call still out then fails its step --
:class:`~flowlift.errors.ToolError` "timed out" for its own timeout,
:class:`~flowlift.errors.DeadlineExceeded` at the run's deadline -- the app is told to
cancel it (``tool.cancelled``), and a result it posts later is discarded and recorded in
the trace (``late_result_ms``; :meth:`flowlift.proxy.workflows.runs.Run.discard_late_result`).
Pure waiting: no I/O, no events (the run emits them).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from flowlift.errors import DeadlineExceeded, StepFailed, ToolError
from flowlift.graph import ToolNode
from flowlift.proxy.workflows.deadline import DeadlineClock


async def await_app(fut: asyncio.Future[Any], node: ToolNode, deadline_s: float | None,
                    clock: DeadlineClock | None) -> StepFailed | None:
    """Wait for ``fut`` (the app's result of ``node``) within the bound of the module
    doc, the run's ``clock`` paused meanwhile.

    Returns:
        None once ``fut`` is done (its result or error is the step's); else the failure
        the step ends with (``fut`` is left pending: the caller cancels it and tells the
        app).
    """
    bound = node.timeout_s if node.timeout_s is not None else deadline_s
    paused = clock.paused() if clock is not None else contextlib.nullcontext()
    async with paused:  # the app has the ball: the deadline clock stops, up to bound
        await asyncio.wait({fut}, timeout=bound)
    if fut.done() or bound is None:
        return None
    if node.timeout_s is not None:
        return ToolError(node.id, f"tool {node.name!r} timed out after {bound:g} s "
                                  "(its timeout_s); its late result, if any, is discarded")
    return DeadlineExceeded(node.id, f"tool {node.name!r} was still out at the run's "
                                     f"deadline of {bound:g} s; its late result, if any, "
                                     "is discarded")
