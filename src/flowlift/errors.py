"""flowlift's errors: one root, user mistakes apart from run-time failures.

::

    FlowliftError
    ├── UserError                     the caller's mistake; fix the input
    │   ├── GraphError                invalid workflow graph (``problems`` lists all)
    │   ├── SemanticVariableError     a placeholder used as if it held a value
    │   │   └── StepWasSkipped        the value of a step its condition skipped (and
    │   │                             that declares no ``default=``)
    │   ├── RequestError              malformed request (``param`` names the field)
    │   │   ├── PayloadTooLarge       body over the configured limit (HTTP 413)
    │   │   ├── RunNotFound           no workflow run has that id (HTTP 404)
    │   │   ├── ResponseNotFound      no stored Responses API response has that id
    │   │   │                         for the caller (HTTP 404)
    │   │   ├── IncompleteBody        a body shorter than its Content-Length, or one
    │   │   │                         that stalled half-sent (HTTP 400)
    │   │   └── ContextLengthExceeded prompt (+ max_tokens) past the model's context;
    │   │                             never retried on the same model
    │   ├── ModelNotFound             model name not served (HTTP 404)
    │   ├── AuthenticationError       missing or wrong proxy API key (HTTP 401)
    │   ├── RunClosed                 steps appended to a run that is closed or finished
    │   │                             (HTTP 409)
    │   └── ConfigError               the proxy's config file or flags are wrong
    └── RunError                      something failed while running
        ├── EngineError               the inference engine failed or is not loaded
        ├── LeaseLost                 a shared store refused a write: another proxy took
        │                             the run over (fencing; HTTP 503, ``Retry-After``)
        ├── ContractError             output does not satisfy the step's contract
        │                             (``step_id``, ``model``, ``attempt``, ``errors``)
        ├── ContentRefused            the provider refused the content (content policy);
        │                             never retried on the same model
        ├── StepFailed                a workflow step failed (``step_id``, ``kind``,
        │   │                         ``attempts``, ``reason``; str() is the reason)
        │   ├── StepSkipped           never ran: an input it reads failed
        │   ├── DeadlineExceeded      the run's deadline passed before it finished
        │   ├── StepCancelled         the run was cancelled before it finished
        │   ├── StepContractError     its output failed its contract (also a ContractError)
        │   ├── ToolError             its ``@tool`` function raised in the app
        │   ├── StepRejected          the model refused the request (context, content)
        │   └── StepEngineError       the engine or upstream failed (after its retries)
        ├── WorkflowFailed            a run ended with failed steps (``failures``: step id
        │                             -> StepFailed)
        ├── ProxyUnavailable          the SDK cannot reach the flowlift proxy
        ├── Overloaded                the proxy sheds load or every backend cools down
        │   │                         (HTTP 429/503 with ``Retry-After``)
        │   ├── ShuttingDown          the proxy drains after SIGTERM (503, ``Retry-After``)
        │   └── StoreUnavailable      the run store's database is unreachable or too slow
        │                             now (503, ``Retry-After``)
        └── UpstreamError             an upstream provider failed (status, body, retry_after_s)

Warnings, not errors: :class:`PlanWarning` (a ``UserWarning``), what the compiler found
before a run that may make a step fail (its output cannot fit ``max_tokens``); the SDK
issues one per problem when the run starts.

Every error knows its HTTP face (:meth:`FlowliftError.to_openai`): the OpenAI error
shape ``{"error": {"message", "type", "param", "code"}}`` with a status code the
official ``openai`` client maps to its exception classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class FlowliftError(Exception):
    """Root of every error flowlift raises."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None
    retry_after_s: float | None = None
    """When set, the HTTP answer carries ``Retry-After`` (whole seconds, rounded up)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI error body for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class UserError(FlowliftError):
    """The caller's mistake; the message says what to change."""

    status = 400
    type = "invalid_request_error"


class GraphError(UserError):
    """An invalid workflow graph. ``problems`` lists every problem found, not the first."""

    code = "invalid_graph"

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        joined = "; ".join(self.problems)
        super().__init__(f"invalid workflow graph ({len(self.problems)} problem(s)): {joined}",
                         param="graph")

    def to_openai(self) -> dict[str, Any]:
        body = super().to_openai()
        body["error"]["problems"] = self.problems
        return body


class SemanticVariableError(UserError):
    """A Semantic Variable (placeholder of a not-yet-known output) used as a value."""

    code = "semantic_variable_misuse"


class StepWasSkipped(SemanticVariableError):
    """The value of a step that was skipped (its ``when`` condition was false, or a
    value it needs was skipped) and that declares no ``default=``: there is none.

    Attributes:
        step_id: the skipped step.
        reason: why the proxy skipped it.
    """

    code = "step_skipped"

    def __init__(self, step_id: str, reason: str) -> None:
        super().__init__(f"step {step_id!r} was skipped ({reason}), so it has no value; "
                         "give it a `default=` to stand for its value, or check "
                         f"`wf.skipped` before reading it")
        self.step_id = step_id
        self.reason = reason


class RequestError(UserError):
    """A malformed request; ``param`` names the offending field."""

    code = "invalid_request"


class PayloadTooLarge(RequestError):
    status = 413
    code = "payload_too_large"


class RunNotFound(RequestError):
    """No workflow run, active, recently finished or stored, has this id (HTTP 404
    ``run_not_found``, on every run route)."""

    status = 404
    code = "run_not_found"

    def __init__(self, run_id: str) -> None:
        super().__init__(f"no workflow run {run_id[:128]!r} is active, recently finished "
                         "or stored here; check the id (runs start with 'wf-')",
                         param="run_id")
        self.run_id = run_id


class ResponseNotFound(RequestError):
    """No stored Responses API response has this id for the caller: never stored
    (``store: false``), expired, deleted, or another tenant's (HTTP 404
    ``response_not_found``; ``param`` names the field that carried the id)."""

    status = 404
    code = "response_not_found"

    def __init__(self, response_id: str, *, param: str | None = None) -> None:
        super().__init__(f"no stored response {response_id[:128]!r} here: it was never "
                         "stored (store: false), has expired or was deleted; start the "
                         "conversation again without previous_response_id", param=param)
        self.response_id = response_id


class IncompleteBody(RequestError):
    """The request body ended (the connection closed) or stalled past the body-read
    timeout before the bytes its ``Content-Length`` announced arrived (HTTP 400
    ``incomplete_body``)."""

    code = "incomplete_body"


class ContextLengthExceeded(RequestError):
    """The prompt (plus ``max_tokens``) does not fit the model's context. Retrying on the
    same model cannot succeed; a model cascade may escalate to a longer-context model."""

    code = "context_length_exceeded"
    retryable = False


class ModelNotFound(UserError):
    status = 404
    code = "model_not_found"

    def __init__(self, model: str, available: Sequence[str]) -> None:
        names = ", ".join(available) or "(none)"
        super().__init__(f"model {model!r} is not served here; available: {names}",
                         param="model")


class AuthenticationError(UserError):
    status = 401
    code = "invalid_api_key"


class PermissionDenied(UserError):
    """The caller may not use what it named: a tool server its key does not reach, an
    MCP server URL the proxy's config does not allow (HTTP 403)."""

    status = 403
    code = "permission_denied"


class ToolServerUnavailable(FlowliftError):
    """A tool server a request named could not be reached or list its tools (HTTP 424,
    as OpenAI answers a hosted MCP server it cannot list)."""

    status = 424
    type = "external_connector_error"
    code = "tool_server_unavailable"


class RunClosed(UserError):
    """Steps appended to a workflow run that no longer takes steps: it was closed (its
    ``with workflow(...)`` block ended), it finished (cancelled, deadline passed), or it
    was submitted whole (not open). HTTP 409."""

    status = 409
    code = "run_closed"


class ConfigError(UserError):
    """A wrong proxy config file, environment variable or flag; ``param`` names it."""

    code = "invalid_config"


class RunError(FlowliftError):
    """Something failed while running."""


class EngineError(RunError):
    status = 503
    type = "server_error"
    code = "engine_error"


class LeaseLost(RunError):
    """A proxy wrote for a run whose lease another proxy has taken since (its fencing
    epoch is stale: :mod:`flowlift.proxy.store.postgres`); the write was refused
    and the run stops on this proxy. Over HTTP (an append to a run lost meanwhile): 503
    with ``Retry-After``, so the client tries again where the run is now."""

    status = 503
    code = "lease_lost"
    retry_after_s = 1.0


class ContractError(RunError):
    """An output that does not satisfy its step's contract."""

    status = 422
    type = "invalid_response_error"
    code = "contract_violation"

    def __init__(self, message: str, *, step_id: str | None = None,
                 errors: Sequence[str] = (), model: str | None = None,
                 attempt: int | None = None) -> None:
        super().__init__(message)
        self.step_id = step_id
        self.errors = list(errors)
        self.model = model
        self.attempt = attempt


class ContentRefused(RunError):
    """The model's provider refused the request or cut the answer for its content policy
    (an upstream ``content_filter`` finish or a ``content_policy_violation`` error).
    Retrying on the same model cannot succeed; a cascade may escalate."""

    status = 400
    type = "invalid_request_error"
    code = "content_filter"
    retryable = False


class NoAnswer(RunError):
    """A loop the proxy ran (the hosted-MCP loop of ``/v1/responses``) got no answer: the
    model's answer after tool results was no answer (empty, or only a fragment of JSON or
    markup: :func:`flowlift.proxy.wire.content_calls.no_answer`) twice, the second time
    after being told why. An agent step fails with :class:`StepFailed` instead."""

    status = 502
    code = "no_answer"


class StepFailed(RunError):
    """A workflow step that failed; ``str()`` is the reason, as the proxy wrote it.

    Attributes:
        step_id: the failed step.
        reason: what happened (the text ``WorkflowFailed.failures`` held before failures
            had types).
        attempts: model calls the step made (retries and escalations included); ``None``
            when not known (a tool step, a step that never ran).
        kind: the machine-readable kind, as the proxy's ``step.failed`` event names it
            (see :data:`STEP_FAILURE_KINDS`).
    """

    kind = "error"

    def __init__(self, step_id: str, reason: str, *, attempts: int | None = None) -> None:
        super().__init__(reason)
        self.step_id = step_id
        self.reason = reason
        self.attempts = attempts

    @property
    def cause(self) -> str:
        """The reason (the name this field had before failures had types)."""
        return self.reason


class StepSkipped(StepFailed):
    """The step never ran: a step whose output it reads failed."""

    kind = "skipped"


class DeadlineExceeded(StepFailed):
    """The run's deadline passed before the step finished (queued or running)."""

    kind = "deadline"


class StepCancelled(StepFailed):
    """The run was cancelled before the step finished."""

    kind = "cancelled"


class StepContractError(StepFailed, ContractError):
    """The step's output failed its contract after its retries (and cascade), or did not
    parse into the step's output type. Also a :class:`ContractError`."""

    kind = "contract"
    step_id: str  # always known here (a ContractError's may be None)


class ToolError(StepFailed):
    """The step's ``@tool`` function raised in the app; the reason quotes the error."""

    kind = "tool"


class StepRejected(StepFailed):
    """The model refused the request: the prompt (plus ``max_tokens``) past its context,
    or content refused by the provider; retrying cannot help."""

    kind = "rejected"


class StepEngineError(StepFailed):
    """The engine or upstream provider failed the step, after the proxy's retries."""

    kind = "engine"


STEP_FAILURE_KINDS: Mapping[str, type[StepFailed]] = {
    cls.kind: cls for cls in (StepFailed, StepSkipped, DeadlineExceeded, StepCancelled,
                              StepContractError, ToolError, StepRejected, StepEngineError)}
"""``step.failed`` event ``kind`` -> the class the SDK raises; unknown kinds (a newer
proxy) are plain :class:`StepFailed`."""


def step_failure(step_id: str, reason: str, kind: str | None = None,
                 attempts: int | None = None) -> StepFailed:
    """The typed failure of a ``step.failed`` event (the one place kinds become types)."""
    return STEP_FAILURE_KINDS.get(kind or "error", StepFailed)(step_id, reason,
                                                                attempts=attempts)


def failure_kind(exc: BaseException) -> str:
    """The ``kind`` of a step that failed with ``exc`` (the proxy's side of the mapping).

    ``StepFailed`` subclasses name themselves; contract failures are ``contract``;
    context-length and content refusals ``rejected``; engine, upstream and overload
    failures ``engine``; anything else ``error``.
    """
    if isinstance(exc, StepFailed):
        return exc.kind
    if isinstance(exc, ContractError):
        return "contract"
    if isinstance(exc, (ContextLengthExceeded, ContentRefused)):
        return "rejected"
    if isinstance(exc, (EngineError, UpstreamError, Overloaded)):
        return "engine"
    return "error"


class WorkflowFailed(RunError):
    """A run ended with failed steps. Outputs of the steps that succeeded stay readable.

    Attributes:
        run_id: the run.
        failures: step id -> :class:`StepFailed` (a typed failure: ``StepSkipped``,
            ``DeadlineExceeded``, ``StepContractError``, ``ToolError``...; ``str()`` of
            each is its reason). Plain strings given here become plain ``StepFailed``.
    """

    def __init__(self, run_id: str, failures: Mapping[str, StepFailed | str]) -> None:
        self.run_id = run_id
        self.failures: dict[str, StepFailed] = {
            k: v if isinstance(v, StepFailed) else StepFailed(k, v)
            for k, v in failures.items()}
        lines = "; ".join(f"{k}: {v}" for k, v in list(self.failures.items())[:5])
        more = "" if len(self.failures) <= 5 else f" (+{len(self.failures) - 5} more)"
        super().__init__(f"workflow run {run_id} had {len(self.failures)} failed step(s): "
                         f"{lines}{more}")


class DeadlineWarning(UserWarning):
    """Not an error: the proxy's compiler estimates that the workflow cannot meet its
    ``deadline_s`` (the SDK warns at submission; ``workflow(..., strict_deadline=True)``
    makes the proxy refuse the run instead, a :class:`RequestError`)."""


class ProxyUnavailable(RunError):
    """The SDK cannot reach the proxy; the message says how to start one, and that a run
    under way resumes when its proxy is started again with the same ``--state-db``."""

    def __init__(self, base_url: str, cause: str) -> None:
        super().__init__(
            f"cannot reach the flowlift proxy at {base_url} ({cause}); start it with "
            "`flowlift serve`, or run your script with `flowlift run SCRIPT`, or set "
            "FLOWLIFT_BASE_URL. A run under way is not lost: restarting the proxy with the "
            "same --state-db resumes it (`flowlift run` restarts its own proxy)")


class Overloaded(RunError):
    """The proxy's own load shedding (429) or no backend available right now (503).

    Always carries ``retry_after_s`` so clients back off instead of hammering.
    """

    def __init__(self, message: str, *, retry_after_s: float, status: int = 503) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = max(retry_after_s, 0.0)
        self.type = "rate_limit_error" if status == 429 else "server_error"
        self.code = "rate_limit_exceeded" if status == 429 else "backends_unavailable"


class ShuttingDown(Overloaded):
    """The proxy is draining (after SIGTERM) and takes no new work: HTTP 503 with
    ``Retry-After``; another replica, or this one once restarted, takes it."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s, status=503)
        self.code = "shutting_down"


class StoreUnavailable(Overloaded):
    """The run store cannot take the call now: its database is unreachable, restarting,
    out of connections or too slow (HTTP 503 with ``Retry-After``, code
    ``store_unavailable``). Runs under way wait for it and go on; retry new work shortly."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s, status=503)
        self.code = "store_unavailable"


class UpstreamError(RunError):
    """An upstream provider's failure, after retries and fallbacks.

    Attributes:
        status: the HTTP status the client gets (the upstream's own for its 4xx/5xx
            answers, 502 for a broken connection or stream, 504 for a timeout).
        body: the upstream's error body when it sent one (passed to the client as is).
        retryable: whether another attempt (or another backend) may succeed.
        retry_after_s: the upstream's ``Retry-After``, when it sent one.
        backend: the name of the backend that failed.
    """

    code = "upstream_error"

    def __init__(self, message: str, *, status: int = 502, body: bytes | None = None,
                 retryable: bool = True, retry_after_s: float | None = None,
                 backend: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.backend = backend
        if status == 504:
            self.code = "upstream_timeout"


class PlanWarning(UserWarning):
    """A problem the compiler found before the run (``CompileReport.warnings``), such as
    a contract whose valid outputs cannot fit the step's ``max_tokens``. Issued by the SDK
    with :func:`warnings.warn` when the run starts; the run goes ahead."""
