"""The flowlift SDK: ``@step``, ``@tool`` and ``workflow``."""

from flowlift.sdk.agents import ProxyTool, proxy_tool
from flowlift.sdk.conditions import Condition, FieldRef, field
from flowlift.sdk.contracts import Regex
from flowlift.sdk.detached import aattach, attach
from flowlift.sdk.steps import Step, Tool, step, tool
from flowlift.sdk.variables import SemanticVariable
from flowlift.sdk.workflow import Workflow, current_workflow, workflow

__all__ = [
           "Condition",
           "FieldRef",
           "ProxyTool",
           "Regex",
           "SemanticVariable",
           "Step",
           "Tool",
           "Workflow",
           "aattach",
           "attach",
           "current_workflow",
           "field",
           "proxy_tool",
           "step",
           "tool",
           "workflow",
]
