"""``workflow(...)``: record steps into a graph, ship it to the proxy, collect results.

::

    with workflow("docs", workflow_class="batch") as wf:
        facts = extract(doc)              # SemanticVariable, nothing runs yet
        label = classify(facts)           # an edge: classify reads extract's output
    print(label.value)                    # after the block: the real output

On exit the graph goes to the proxy (``POST /v1/workflows``), which runs every node as
soon as its inputs are known and streams events back; ``@tool`` steps run here, in the
app, when the proxy asks. ``async with`` works the same inside an event loop.

Reading a value inside the block -- ``var.get()`` in ``with``, ``await var`` in
``async with`` -- starts the run with what is recorded so far and waits for that value;
steps recorded afterwards join the same run (an open run: :mod:`flowlift.sdk.open_run`).

Errors on exit:
    GraphError / RequestError: the proxy rejected the graph (nothing ran).
    ProxyUnavailable: no proxy at ``base_url``.
    AuthenticationError: the proxy wants an API key (``api_key=`` or
        ``$FLOWLIFT_API_KEY``) and got none or a wrong one (HTTP 401).
    WorkflowFailed: some steps failed; the others' ``.value`` stay readable.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
from pydantic import BaseModel

from flowlift.credentials import bearer_headers, default_api_key
from flowlift.errors import (
    GraphError,
    RequestError,
    SemanticVariableError,
    StepContractError,
    StepFailed,
    StepWasSkipped,
    UserError,
    WorkflowFailed,
    step_failure,
)
from flowlift.graph import Arg, Graph, InputNode, Items, Node, Ref, ToolNode, project
from flowlift.sdk import recording
from flowlift.sdk.markers import check_literal
from flowlift.sdk.variables import SemanticVariable
from flowlift.tracing.summary import format_stage_table, stage_summary

if TYPE_CHECKING:
    from flowlift.sdk.open_run import AsyncOpenRun, SyncOpenRun
    from flowlift.sdk.steps import Tool

DEFAULT_BASE_URL = "http://127.0.0.1:8470"
_current: contextvars.ContextVar[Workflow | None] = contextvars.ContextVar(
    "flowlift_workflow", default=None)


def current_workflow() -> Workflow | None:
    """The workflow being recorded in this context, if any."""
    return _current.get()


def default_base_url() -> str:
    return os.environ.get("FLOWLIFT_BASE_URL", DEFAULT_BASE_URL).rstrip("/")


class Workflow:
    """Records a graph of steps; runs it on the proxy when the block exits.

    Args:
        name: shown in traces and reports.
        base_url: the proxy (default ``$FLOWLIFT_BASE_URL`` or ``http://127.0.0.1:8470``),
            or several replicas of one (a list: proxies on one shared run store, see
            README "Several proxies on one database"): the run is posted to the first
            that accepts a connection, and when its event stream is lost the SDK
            follows the run on the next one (events replay from the store; nothing is
            submitted or run twice). A gateway in front of the replicas is one URL.
        api_key: the proxy's API key when its config sets ``[server] api_keys_env``
            (default ``$FLOWLIFT_API_KEY``; none: no ``Authorization`` header), sent as
            ``Authorization: Bearer`` on every request of this workflow; never logged,
            traced or quoted in errors.
        workflow_class: ``"interactive"`` or ``"batch"``.
        deadline_s: one deadline for the whole run, in seconds. When the proxy's
            compiler finds it infeasible the run goes ahead with a
            :class:`~flowlift.errors.DeadlineWarning` at submission.
        strict_deadline: refuse such a run instead (``RequestError``, HTTP 400).
        trace_path: where to write the run's trace (JSON lines) when it finishes.
        metadata: free-form labels carried into the trace.
        transport: an ``httpx`` transport (tests inject one; default: real sockets).
        tool_workers: how many ``@tool`` calls may run at once (sync mode threads).
        submit: ``False`` only records the graph (``wf.graph()``); nothing is shipped.
        reconnect_s: how long to keep reconnecting to a run whose event stream was lost
            (a restarted proxy resumes the run; ``@tool`` steps are never run twice).
        progress: draw done / running / queued / failed counts to stderr while it runs
            (:mod:`flowlift.sdk.progress`); None: when ``$FLOWLIFT_PROGRESS=1`` (set by
            ``flowlift run``).
        detach: submit at block exit and return at once with ``wf.run_id`` set, not
            waiting for results: the run outlives this script (the proxy never cancels
            it for want of a listener); read its outputs later with
            :func:`flowlift.attach` or ``flowlift result RUN_ID``. Its ``@tool`` steps
            wait for a client that has the functions (:mod:`flowlift.sdk.detached`).

    Attributes (after the run):
        run_id, status, trace (list of records), skipped ({step_id: why}: steps the
        proxy did not take, :mod:`flowlift.sdk.conditions`; not failures; reading one
        raises :class:`~flowlift.errors.StepWasSkipped` unless it has a ``default=``),
        failures ({step_id: StepFailed}: typed
        failures, :class:`~flowlift.errors.StepSkipped`,
        :class:`~flowlift.errors.DeadlineExceeded`, :class:`~flowlift.errors.ToolError`...;
        ``str()`` of each is the reason text).
    """

    def __init__(self, name: str = "workflow", *, base_url: str | Sequence[str] | None = None,
                 workflow_class: Literal["interactive", "batch"] = "interactive",
                 deadline_s: float | None = None, trace_path: str | os.PathLike[str] | None = None,
                 metadata: Mapping[str, Any] | None = None,
                 transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
                 tool_workers: int = 8, submit: bool = True,
                 reconnect_s: float = 300.0, progress: bool | None = None,
                 api_key: str | None = None, strict_deadline: bool = False,
                 detach: bool = False) -> None:
        self.name = name
        urls = [base_url] if base_url is None or isinstance(base_url, str) else list(base_url)
        if not urls:
            raise RequestError("base_url: give a proxy URL (or a list of replicas' URLs), "
                               "not an empty list", param="base_url")
        self.base_urls = tuple((url or default_base_url()).rstrip("/") for url in urls)
        self.base_url = self.base_urls[0]  # the replica in use (see client.next_replica)
        self._api_key = api_key or default_api_key()
        self.workflow_class = workflow_class
        self.deadline_s = deadline_s
        self.strict_deadline = strict_deadline
        self.trace_path = Path(trace_path) if trace_path else None
        self.metadata = dict(metadata or {})
        self.transport = transport
        self.tool_workers = tool_workers
        recorder = recording.active()  # `flowlift compile workflow.py`: record only
        self.submit = submit and recorder is None
        if recorder is not None:
            recorder.workflows.append(self)
        self.reconnect_s = reconnect_s
        self.progress = progress
        self.detach = detach
        self.nonce = secrets.token_hex(6)
        self.nodes: list[Node] = []
        self.tools: dict[str, Tool[Any, Any]] = {}
        self.agent_tools: dict[str, dict[str, Tool[Any, Any]]] = {}  # agent step -> tools
        self.served_tools: dict[str, Tool[Any, Any]] = {}  # an attached run's, by name
        self.attached = False  # followed by flowlift.attach: serves only served_tools
        self._parsers: dict[str, Callable[[Any], Any]] = {}
        self._counts: dict[str, int] = {}
        self._outputs: dict[str, Any] = {}
        self.failures: dict[str, StepFailed] = {}
        self.skipped: dict[str, str] = {}  # step id -> why the proxy skipped it
        self._defaults: dict[str, Any] = {}  # a conditional step's default= (Python)
        self.run_id: str | None = None
        self.status = "recording"
        self.trace: list[dict[str, Any]] = []
        self._token: contextvars.Token[Workflow | None] | None = None
        self._mode: Literal["sync", "async"] | None = None  # set while the block runs
        self._open: SyncOpenRun | AsyncOpenRun | None = None  # after a read in the block

    # -- recording ---------------------------------------------------------------
    def new_id(self, name: str) -> str:
        n = self._counts.get(name, 0) + 1
        self._counts[name] = n
        return f"{name}_{n}"

    def add_node(self, node: Node, *, parse: Callable[[Any], Any] | None = None,
                 fields: frozenset[str] | None = frozenset()) -> SemanticVariable:
        if self.status != "recording" and not self._growing:
            raise UserError(f"workflow {self.name!r} is already {self.status}; record steps "
                            "inside its `with` block")
        self.nodes.append(node)
        if parse is not None:
            self._parsers[node.id] = parse
        return SemanticVariable(self, node.id, fields=fields)

    def add_tool(self, tool: Tool[Any, Any], args: tuple[Arg, ...],
                 kwargs: dict[str, Arg],
                 conditional: Mapping[str, Any] | None = None) -> SemanticVariable:
        """Record a ``@tool`` call (``conditional``: its ``when``/``default`` fields)."""
        node = ToolNode(id=self.new_id(tool.name), name=tool.name, args=args, kwargs=kwargs,
                        pure=tool.pure, timeout_s=tool.timeout_s, **(conditional or {}))
        self.tools[node.id] = tool
        return self.add_node(node, fields=None)

    def input(self, value: Any, name: str = "input") -> SemanticVariable:
        """Add a constant as a graph input (shared by every step that reads it).

        Raises:
            SemanticVariableError: ``value`` holds a Semantic Variable or a piece of one
                (an input is a constant: pass the variable to the steps themselves).
        """
        check_literal(json.dumps(value, ensure_ascii=False, default=str),
                      f"workflow input {name!r}")
        return self.add_node(InputNode(id=self.new_id(name), value=value))

    def first(self, *steps: SemanticVariable, name: str | None = None) -> SemanticVariable:
        """The first of ``steps`` to deliver a result that passes its contract; the others
        are cancelled on the proxy (:mod:`flowlift.sdk.groups`).

        Raises:
            UserError: no steps, or one that is not a step's whole output.
        """
        from flowlift.sdk.groups import group

        return group(self, "first", steps, name=name)

    def quorum(self, *steps: SemanticVariable, k: int,
               agree_on: str | Sequence[str] | None = None,
               name: str | None = None) -> SemanticVariable:
        """The output of the first ``k`` of ``steps`` whose results agree on field
        ``agree_on`` (a dotted path; None: the whole output); the others are cancelled
        as soon as they agree (:mod:`flowlift.sdk.groups`). No quorum possible: the
        group fails.

        Raises:
            UserError: no steps, a ``k`` outside 1..len(steps).
        """
        from flowlift.sdk.groups import group

        return group(self, "quorum", steps, k=k, agree_on=agree_on, name=name)

    def map(self, step: Any, items: SemanticVariable, *args: Any, max_items: int,
            name: str | None = None, **kwargs: Any) -> SemanticVariable:
        """One run of ``step`` per item of the list ``items`` (a step's list-valued
        output or field), made by the proxy once the list is known; the item is the
        step's first argument, ``args``/``kwargs`` the rest (:mod:`flowlift.sdk.fanout`).
        The value: the items' outputs in order. More than ``max_items`` items fail it.

        Raises:
            UserError: ``step`` is no ``@step``, ``items`` no Semantic Variable, a bad
                ``max_items``.
        """
        from flowlift.sdk.fanout import map_step

        return map_step(self, step, items, args, kwargs, max_items=max_items, name=name)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[Node]]:
        """Record into a separate list (a map's step template), not the graph."""
        saved, self.nodes = self.nodes, []
        try:
            yield self.nodes
        finally:
            self.nodes = saved

    def parser_of(self, step_id: str) -> Callable[[Any], Any] | None:
        """How step ``step_id``'s JSON output becomes its value (None: as is)."""
        return self._parsers.get(step_id)

    def graph(self) -> Graph:
        """The recorded graph in wire form (``wf.graph().to_json()``: its JSON text).

        Raises:
            GraphError: nothing was recorded (no step or tool was called in the block).
        """
        if not self.nodes:
            raise GraphError([f"workflow {self.name!r} has no steps: call a @step or @tool "
                              "function inside its `with workflow(...)` block"])
        return Graph(name=self.name, workflow_class=self.workflow_class,
                     deadline_s=self.deadline_s, strict_deadline=self.strict_deadline,
                     metadata=self.metadata, detached=self.detach, nodes=tuple(self.nodes))

    @property
    def _growing(self) -> bool:
        """Inside the block of an open run: steps still join it."""
        return self._open is not None and self._mode is not None

    # -- reading inside the block (open runs) -----------------------------------------
    def wait_for(self, var: SemanticVariable) -> Any:
        """``var.get()``: in a ``with workflow(...)`` block, ship the steps recorded so
        far and wait for ``var``'s value; after the run, its value.

        Raises:
            UserError: inside ``async with`` (use ``await var``), or ``submit=False``.
            SemanticVariableError: outside the block, before the run.
            StepFailed, GraphError, RunClosed, ProxyUnavailable: see
                :mod:`flowlift.sdk.open_run`.
        """
        from flowlift.sdk.open_run import SyncOpenRun

        if self._readable_now(var):
            return var.value
        if self._mode == "async":
            raise UserError("inside `async with workflow(...)` read a value with `await "
                            "var`: `var.get()` would block the event loop the run's "
                            "events arrive on", param="get")
        if self._open is None:
            self._open = SyncOpenRun(self)
        assert isinstance(self._open, SyncOpenRun)
        return self._open.read(var)

    async def await_value(self, var: SemanticVariable) -> Any:
        """``await var``: in an ``async with workflow(...)`` block, ship the steps
        recorded so far and wait for ``var``'s value; after the run, its value.

        Raises:
            UserError: inside a sync ``with`` (use ``var.get()``), or ``submit=False``.
            SemanticVariableError: outside the block, before the run.
            StepFailed, GraphError, RunClosed, ProxyUnavailable: see
                :mod:`flowlift.sdk.open_run`.
        """
        from flowlift.sdk.open_run import AsyncOpenRun

        if self._readable_now(var):
            return var.value
        if self._mode == "sync":
            raise UserError("`await var` needs `async with workflow(...)`; inside `with "
                            "workflow(...)` read a value with `var.get()`", param="await")
        if self._open is None:
            self._open = AsyncOpenRun(self)
        assert isinstance(self._open, AsyncOpenRun)
        return await self._open.read(var)

    def _readable_now(self, var: SemanticVariable) -> bool:
        """True when ``var`` is read without a run (outside the block); raises where
        no value can come."""
        if self._mode is None:
            if var.ready:
                return True
            raise SemanticVariableError(
                f"the output of step {var.step_id!r} is not known: workflow {self.name!r} "
                f"is {self.status}. Read values inside its block (`await var` or "
                "`var.get()`), or with `.value` after it ran")
        if not self.submit:
            recording.stop(var.step_id, "a read inside the block")
            raise UserError(f"workflow {self.name!r} only records (submit=False): nothing "
                            "runs, so no value can be read", param="submit")
        return False

    # -- results -------------------------------------------------------------------
    def has_output(self, step_id: str) -> bool:
        return step_id in self._outputs or step_id in self.failures \
            or step_id in self.skipped

    @property
    def outputs(self) -> dict[str, Any]:
        """The finished steps' outputs so far, ``{step_id: value}`` (parsed where the
        step has an output type)."""
        return dict(self._outputs)

    def value(self, step_id: str) -> Any:
        """Step ``step_id``'s output (an attached run's, by its wire id).

        Raises:
            StepFailed: the step failed (its typed failure).
            SemanticVariableError: the step has no output yet.
        """
        return self.value_of(step_id)

    def value_of(self, step_id: str, path: tuple[str, ...] = ()) -> Any:
        if step_id in self.failures:
            raise self.failures[step_id].with_traceback(None)
        if step_id in self.skipped and step_id not in self._outputs:
            raise StepWasSkipped(step_id, self.skipped[step_id])
        if step_id not in self._outputs:
            raise SemanticVariableError(f"step {step_id!r} has no output yet")
        value = self._outputs[step_id]
        for key in path:
            value = getattr(value, key) if isinstance(value, BaseModel) else project(value, (key,))
        return value

    def record_output(self, step_id: str, raw: Any) -> None:
        parse = self._parsers.get(step_id)
        try:
            self._outputs[step_id] = parse(raw) if parse else raw
        except ValueError as exc:  # pydantic ValidationError is a ValueError
            self.failures[step_id] = StepContractError(
                step_id, f"output does not parse into the step's output type: {exc}")

    def record_skip(self, step_id: str, reason: str, *, has_value: bool = False,
                    value: Any = None) -> None:
        """Record a ``step.skipped`` event: the step stands for its ``default=`` (the
        Python value given, else the event's JSON ``value``) or has no value."""
        self.skipped[step_id] = reason
        if step_id in self._defaults:
            self._outputs[step_id] = self._defaults[step_id]
        elif has_value:
            self.record_output(step_id, value)

    def set_default(self, step_id: str, value: Any) -> None:
        """Keep ``default=`` of a conditional step as given (a model instance stays one)."""
        self._defaults[step_id] = value

    def record_failure(self, step_id: str, error: str, *, kind: str | None = None,
                       attempts: int | None = None) -> None:
        """Record a ``step.failed`` event as its typed failure
        (:func:`~flowlift.errors.step_failure`)."""
        self.failures[step_id] = step_failure(step_id, error, kind, attempts)

    def adopt_tool(self, step_id: str, name: str | None) -> bool:
        """For an attached run (:func:`flowlift.attach` with ``tools``): take on
        ``@tool`` step ``step_id`` when a function named ``name`` was given and the step
        has not finished; its JSON arguments are parsed by the function's annotations
        (:meth:`~flowlift.sdk.steps.Tool.typed`).

        Returns:
            Whether this workflow now runs the step.
        """
        tool = self.served_tools.get(name or "")
        if tool is None or step_id in self._outputs or step_id in self.failures:
            return False
        self.tools[step_id] = tool.typed()
        return True

    def tool_arguments(self, step_id: str, args: list[Any],
                       kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Resolved wire arguments -> Python values (whole structured outputs re-parsed)."""
        node = next((n for n in self.nodes if n.id == step_id), None)
        if node is None:  # an adopted step of an attached run: its tool parses them
            return list(args), dict(kwargs)
        assert isinstance(node, ToolNode)

        def convert(wire: Arg, value: Any) -> Any:
            if isinstance(wire, Ref) and not wire.path and wire.ref in self._parsers:
                return self._parsers[wire.ref](value)
            if isinstance(wire, Items) and isinstance(value, list):  # skipped items left out
                kept = [w for w in wire.items if not (isinstance(w, Ref) and w.ref in
                                                      self.skipped and w.ref not in self._outputs)]
                return [convert(w, v) for w, v in zip(kept, value, strict=True)]
            return value

        py_args = [convert(w, v) for w, v in zip(node.args, args, strict=True)]
        py_kwargs = {k: convert(node.kwargs[k], v) for k, v in kwargs.items()}
        return py_args, py_kwargs

    def finish(self, run_id: str, status: str, trace: list[dict[str, Any]]) -> None:
        self.run_id, self.status, self.trace = run_id, status, trace
        if self.trace_path is not None:
            self.trace_path.parent.mkdir(parents=True, exist_ok=True)
            with self.trace_path.open("w", encoding="utf-8") as f:
                for rec in trace:
                    f.write(json.dumps(rec) + "\n")

    def summary(self) -> dict[str, Any]:
        """Per-stage time split of the finished run (see :func:`stage_summary`)."""
        return stage_summary(self.trace)

    def report(self) -> str:
        """A printable table of where the time went, per stage."""
        return format_stage_table(self.summary())

    # -- running -------------------------------------------------------------------
    def http_headers(self) -> dict[str, str]:
        """Default headers of every request to the proxy (the API key, if any)."""
        return bearer_headers(self._api_key)

    def cancel(self) -> bool:
        """Cancel the running run (from another thread): queued steps are dropped and
        running engine requests aborted. False when it has not started or has ended."""
        if self.run_id is None or self.status != "running":
            return False
        transport = self.transport if isinstance(self.transport, httpx.BaseTransport) else None
        with httpx.Client(base_url=self.base_url, transport=transport, timeout=30,
                          headers=self.http_headers()) as c:
            r = c.delete(f"/v1/workflows/{self.run_id}")
        return _cancelled(r)

    async def acancel(self) -> bool:
        """:meth:`cancel` for async code."""
        if self.run_id is None or self.status != "running":
            return False
        transport = (self.transport if isinstance(self.transport, httpx.AsyncBaseTransport)
                     else None)
        async with httpx.AsyncClient(base_url=self.base_url, transport=transport,
                                     timeout=30, headers=self.http_headers()) as c:
            r = await c.delete(f"/v1/workflows/{self.run_id}")
        return _cancelled(r)

    def _abandoned(self) -> None:
        if self.status not in ("succeeded", "failed", "cancelled"):
            self.status = "abandoned"

    def _check_failed(self) -> None:
        if self.failures:
            raise WorkflowFailed(self.run_id or "?", self.failures)

    def __enter__(self) -> Workflow:
        self._token = _current.set(self)
        self._mode = "sync"
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._token is not None
        _current.reset(self._token)
        self._mode = None
        if self._open is not None:
            from flowlift.sdk.open_run import SyncOpenRun

            assert isinstance(self._open, SyncOpenRun)
            if exc_type is not None:
                self._open.abandon(exc)
                self._abandoned()
                return
            self._open.finish()
            self._check_failed()
            return
        if exc_type is not None or not self.submit:
            self.status = "abandoned" if exc_type is not None else "recorded"
            return
        if self.detach:
            from flowlift.sdk.detached import submit_detached

            submit_detached(self)
            return
        from flowlift.sdk.client import run_sync

        run_sync(self)
        self._check_failed()

    async def __aenter__(self) -> Workflow:
        self.__enter__()
        self._mode = "async"
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._token is not None
        _current.reset(self._token)
        self._mode = None
        if self._open is not None:
            from flowlift.sdk.open_run import AsyncOpenRun

            assert isinstance(self._open, AsyncOpenRun)
            if exc_type is not None:
                await self._open.abandon(exc)
                self._abandoned()
                return
            await self._open.finish()
            self._check_failed()
            return
        if exc_type is not None or not self.submit:
            self.status = "abandoned" if exc_type is not None else "recorded"
            return
        if self.detach:
            from flowlift.sdk.detached import asubmit_detached

            await asubmit_detached(self)
            return
        from flowlift.sdk.client import run_async

        await run_async(self)
        self._check_failed()


def _cancelled(r: httpx.Response) -> bool:
    """The proxy's answer to a cancel; a refused key raises AuthenticationError."""
    if r.status_code == 401:
        from flowlift.sdk.client import _error_from

        raise _error_from(r.status_code, r.content)
    return bool(r.json().get("cancelled"))


workflow = Workflow
