"""flowlift's errors: one root, user mistakes apart from run-time failures.

::

    FlowliftError
    ├── UserError                     the caller's mistake; fix the input
    │   ├── GraphError                invalid workflow graph (``problems`` lists all)
    │   ├── SemanticVariableError     a placeholder used as if it held a value
    │   ├── RequestError              malformed request (``param`` names the field)
    │   │   └── PayloadTooLarge       body over the configured limit (HTTP 413)
    │   └── ModelNotFound             model name not served (HTTP 404)
    └── RunError                      something failed while running
        ├── EngineError               the inference engine failed or is not loaded
        ├── ContractError             output does not satisfy the step's contract
        ├── StepFailed                a workflow step failed (``step_id``, ``cause``)
        ├── WorkflowFailed            a run ended with failed steps (``failures``)
        └── ProxyUnavailable          the SDK cannot reach the flowlift proxy

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


class RequestError(UserError):
    """A malformed request; ``param`` names the offending field."""

    code = "invalid_request"


class PayloadTooLarge(RequestError):
    status = 413
    code = "payload_too_large"


class ModelNotFound(UserError):
    status = 404
    code = "model_not_found"

    def __init__(self, model: str, available: Sequence[str]) -> None:
        names = ", ".join(available) or "(none)"
        super().__init__(f"model {model!r} is not served here; available: {names}",
                         param="model")


class RunError(FlowliftError):
    """Something failed while running."""


class EngineError(RunError):
    status = 503
    type = "server_error"
    code = "engine_error"


class ContractError(RunError):
    """An output that does not satisfy its step's contract."""

    status = 422
    type = "invalid_response_error"
    code = "contract_violation"

    def __init__(self, message: str, *, step_id: str | None = None,
                 errors: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.step_id = step_id
        self.errors = list(errors)


class StepFailed(RunError):
    def __init__(self, step_id: str, cause: str) -> None:
        super().__init__(f"step {step_id!r} failed: {cause}")
        self.step_id = step_id
        self.cause = cause


class WorkflowFailed(RunError):
    """A run ended with failed steps. Outputs of the steps that succeeded stay readable."""

    def __init__(self, run_id: str, failures: Mapping[str, str]) -> None:
        self.run_id = run_id
        self.failures = dict(failures)
        lines = "; ".join(f"{k}: {v}" for k, v in list(self.failures.items())[:5])
        more = "" if len(self.failures) <= 5 else f" (+{len(self.failures) - 5} more)"
        super().__init__(f"workflow run {run_id} had {len(self.failures)} failed step(s): "
                         f"{lines}{more}")


class ProxyUnavailable(RunError):
    def __init__(self, base_url: str, cause: str) -> None:
        super().__init__(
            f"cannot reach the flowlift proxy at {base_url} ({cause}); start it with "
            "`flowlift serve`, or run your script with `flowlift run SCRIPT`, or set "
            "FLOWLIFT_BASE_URL")
