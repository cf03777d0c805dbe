"""flowlift: workflow-aware LLM inference.

Public face::

    from flowlift import step, tool, workflow
"""

from flowlift.errors import (
    ContractError,
    DeadlineExceeded,
    EngineError,
    FlowliftError,
    GraphError,
    PlanWarning,
    ProxyUnavailable,
    RequestError,
    SemanticVariableError,
    StepCancelled,
    StepContractError,
    StepEngineError,
    StepFailed,
    StepRejected,
    StepSkipped,
    StepWasSkipped,
    ToolError,
    UserError,
    WorkflowFailed,
)
from flowlift.sdk import (
    ProxyTool,
    Regex,
    SemanticVariable,
    Workflow,
    aattach,
    attach,
    field,
    proxy_tool,
    step,
    tool,
    workflow,
)

__version__ = "0.1.0"

__all__ = [
    "ContractError",
    "DeadlineExceeded",
    "EngineError",
    "FlowliftError",
    "GraphError",
    "PlanWarning",
    "ProxyTool",
    "ProxyUnavailable",
    "Regex",
    "RequestError",
    "SemanticVariable",
    "SemanticVariableError",
    "StepCancelled",
    "StepContractError",
    "StepEngineError",
    "StepFailed",
    "StepRejected",
    "StepSkipped",
    "StepWasSkipped",
    "ToolError",
    "UserError",
    "Workflow",
    "WorkflowFailed",
    "__version__",
    "aattach",
    "attach",
    "field",
    "proxy_tool",
    "step",
    "tool",
    "workflow",
]
