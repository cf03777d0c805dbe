"""Names from the OpenTelemetry GenAI semantic conventions, and flowlift's own ids.

Spans: ``invoke_workflow {name}``, ``chat {model}``, ``text_completion {model}``,
``embeddings {model}``, ``execute_tool {name}`` (semconv "gen-ai-spans"); attributes as
below. Cache-read input tokens are ``gen_ai.usage.cache_read.input_tokens`` (semconv
1.37+; ``opentelemetry-semantic-conventions`` 0.58b0+ names it
``GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS``). flowlift's ids go on every span as
``flowlift.workflow.id`` and ``flowlift.step.id``.
"""

from __future__ import annotations

from typing import Any

OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ_TOKENS = "gen_ai.usage.cache_read.input_tokens"
TOOL_NAME = "gen_ai.tool.name"
TOOL_CALL_ID = "gen_ai.tool.call.id"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
ERROR_TYPE = "error.type"

WORKFLOW_ID = "flowlift.workflow.id"
WORKFLOW_NAME = "flowlift.workflow.name"
STEP_ID = "flowlift.step.id"
STAGE = "flowlift.stage"

OPERATIONS = {"/chat/completions": "chat", "/completions": "text_completion",
              "/embeddings": "embeddings", "/responses": "chat"}
"""OpenAI API path -> ``gen_ai.operation.name``."""


def provider_name(engine: Any) -> str:
    """``gen_ai.provider.name`` of an engine: an engine's own ``provider_name`` if it has
    one; upstream OpenAI-compatible backends are ``openai`` (the API they speak); the
    embedded engine is ``vllm``."""
    own = getattr(engine, "provider_name", None)
    if isinstance(own, str):
        return own
    return "openai" if type(engine).__name__ == "UpstreamEngine" else "vllm"


def usage_attributes(prompt: int | None, completion: int | None,
                     cached: int | None) -> dict[str, int]:
    """The usage attributes that are known (None: left out)."""
    out = {}
    for key, value in ((INPUT_TOKENS, prompt), (OUTPUT_TOKENS, completion),
                       (CACHE_READ_TOKENS, cached)):
        if value is not None:
            out[key] = int(value)
    return out
