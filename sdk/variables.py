"""Semantic Variables: placeholders for step outputs that are not known yet.

Inside a workflow, calling a step returns a :class:`SemanticVariable`. Formatting one
into a string (f-strings, ``str()``, ``format()``) writes a *marker*; the step's prompt
is then split at the markers into literal text and references, which become the
graph's edges (Parrot, Lin et al., OSDI'24). Reading the value -- ``await var`` in
``async with workflow(...)``, ``var.get()`` in ``with workflow(...)`` -- waits for the
step (the run grows: :mod:`flowlift.sdk.open_run`). Any other use -- truth tests,
``len()``, arithmetic, comparison, iteration -- raises :class:`SemanticVariableError`
with the fix.

Markers (:mod:`flowlift.sdk.markers`) are made of characters ordinary text never holds
and carry a per-workflow random nonce, so user text can never be mistaken for one, and
any string operation that changes a marker (``str(v).upper()``, ``str(v)[:10]``,
``f"{v!r}"``...) is refused when the step is recorded, with the step and the operation
named: the model never receives a mangled placeholder.

``str(v)`` (also ``format(v)``, ``"%s" % v``) is the marker itself, a
:class:`~flowlift.sdk.markers.MarkerText`: meaningful only inside a prompt or a tool
argument of the workflow that recorded ``v``, unreadable anywhere else (logs show a few
boxes), and never the value, even after the run: read ``v.value`` for that, and log
``repr(v)`` (``<SemanticVariable ask_1: pending>``).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NoReturn

from flowlift.errors import SemanticVariableError
from flowlift.graph import Ref
from flowlift.sdk import recording
from flowlift.sdk.markers import marker

if TYPE_CHECKING:
    from flowlift.sdk.workflow import Workflow

_HOW = ("A Semantic Variable is a placeholder for the output of step {sid!r}, which is not "
        "known until that step runs. To branch on it, await it (or `var.get()` in a sync "
        "`with workflow(...)` block) first: that waits for the step and returns its value. "
        "Otherwise use it inside an f-string of a later step's prompt, pass it to a @step "
        "or @tool, or read `.value` after the `with workflow(...)` block.")


class SemanticVariable:
    """The output of a step that has not run yet.

    Attributes:
        step_id: the graph node that produces it.
        path: field names when this is a projection of a structured output
            (``ticket.component``). Outputs of ``@tool`` steps are JSON of unknown shape:
            any attribute projects (``hits.names``), checked when the run reaches it.

    After the workflow finishes, :attr:`value` holds the output (the parsed pydantic
    model for steps with an ``output=`` model, a label for ``Literal`` outputs, text
    otherwise). Inside the block, ``await var`` (async) or :meth:`get` (sync) waits for
    it. ``get`` is a method, so a structured output's field named ``get`` is not a
    projection.
    """

    __slots__ = ("_fields", "_workflow", "path", "step_id")
    # set once in __init__ through object.__setattr__ (__setattr__ refuses assignment)
    _workflow: Workflow
    step_id: str
    path: tuple[str, ...]
    _fields: frozenset[str] | None

    def __init__(self, workflow: Workflow, step_id: str, path: tuple[str, ...] = (),
                 fields: frozenset[str] | None = frozenset()) -> None:
        object.__setattr__(self, "_workflow", workflow)
        object.__setattr__(self, "step_id", step_id)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "_fields", fields)

    # -- the allowed uses -------------------------------------------------------
    def __format__(self, spec: str) -> str:
        if spec:
            raise SemanticVariableError(
                f"format spec {spec!r} on a Semantic Variable: the value is not known yet. "
                + _HOW.format(sid=self.step_id))
        return marker(self._workflow.nonce, self.step_id, self.path)

    def __str__(self) -> str:
        return self.__format__("")

    def __repr__(self) -> str:
        dotted = "".join(f".{p}" for p in self.path)
        state = repr(self.value) if self.ready else "pending"
        return f"<SemanticVariable {self.step_id}{dotted}: {state}>"

    def __getattr__(self, name: str) -> SemanticVariable:
        if name.startswith("_") or (self._fields is not None and name not in self._fields):
            raise AttributeError(
                f"Semantic Variable of step {self.step_id!r} has no field {name!r}"
                + (f" (fields: {', '.join(sorted(self._fields))})" if self._fields else
                   "; only outputs with a pydantic `output=` model have fields"))
        return SemanticVariable(self._workflow, self.step_id, (*self.path, name),
                                fields=None if self._fields is None else frozenset())

    @property
    def ref(self) -> Ref:
        return Ref(ref=self.step_id, path=self.path)

    @property
    def ready(self) -> bool:
        """True once the workflow has produced (or failed) this output."""
        return self._workflow.has_output(self.step_id)

    @property
    def value(self) -> Any:
        """The step's output once it is known (after the workflow ran, or once read);
        never waits.

        Raises:
            SemanticVariableError: not known yet.
            StepFailed: when the step (or one it depends on) failed.
        """
        wf = self._workflow
        if not wf.has_output(self.step_id):
            recording.stop(self.step_id, "`.value`")  # `flowlift compile workflow.py`
            if wf.detach and wf.run_id is not None:  # the block ended; the run goes on
                raise SemanticVariableError(
                    f"the output of step {self.step_id!r} is not known here: this "
                    f"workflow was detached (run {wf.run_id}). Read it with "
                    f"`flowlift.attach({wf.run_id!r}).value({self.step_id!r})` or "
                    f"`flowlift result {wf.run_id}`.")
            raise SemanticVariableError(
                f"the output of step {self.step_id!r} is not known yet (`.value` never "
                "waits). " + _HOW.format(sid=self.step_id))
        return wf.value_of(self.step_id, self.path)

    def get(self) -> Any:
        """Wait for the value (the sync spelling of ``await var``).

        Inside ``with workflow(...)``: ships every step recorded so far that the proxy
        has not seen (the first read starts the run), waits for this step, and returns
        its output parsed like :attr:`value`; steps recorded afterwards join the same
        run. After the workflow ran: :attr:`value`.

        Raises:
            UserError: inside ``async with workflow(...)`` (``await var`` there), or in a
                ``submit=False`` workflow.
            SemanticVariableError: outside the block, before the run.
            StepFailed: the step (or one it depends on) failed.
            GraphError, RunClosed, ProxyUnavailable: the steps shipped with this read
                were rejected, the run has ended, or the proxy is gone.
        """
        return self._workflow.wait_for(self)

    def __await__(self) -> Generator[Any, None, Any]:
        """``await var``: :meth:`get` for ``async with workflow(...)`` blocks."""
        return self._workflow.await_value(self).__await__()

    # -- everything else is a mistake -----------------------------------------
    def _misuse(self, what: str) -> NoReturn:
        raise SemanticVariableError(f"{what} on a Semantic Variable: " +
                                    _HOW.format(sid=self.step_id))

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        self._misuse(f"setting attribute {name!r}")

    def __bool__(self) -> bool:
        self._misuse("truth test (`if var:`)")

    def __len__(self) -> int:
        self._misuse("len()")

    def __iter__(self) -> NoReturn:
        self._misuse("iteration")

    def __contains__(self, item: object) -> bool:
        self._misuse("`in` test")

    def __getitem__(self, key: object) -> NoReturn:
        self._misuse("indexing")

    def __eq__(self, other: object) -> bool:
        self._misuse("comparison (==)")

    def __ne__(self, other: object) -> bool:
        self._misuse("comparison (!=)")

    def __lt__(self, other: object) -> bool:
        self._misuse("comparison (<)")

    __le__ = __gt__ = __ge__ = __lt__

    def __hash__(self) -> int:
        return hash((id(self._workflow), self.step_id, self.path))

    def __add__(self, other: object) -> NoReturn:
        self._misuse("`+` (build prompts with an f-string instead)")

    __radd__ = __mul__ = __rmul__ = __sub__ = __truediv__ = __mod__ = __add__

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        self._misuse("calling it (a method of the value?)")

    def __int__(self) -> int:
        self._misuse("int()")

    def __float__(self) -> float:
        self._misuse("float()")
