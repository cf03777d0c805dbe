"""Public test doubles (like ``structlog.testing``): use them in your own tests.

:class:`FakeEngine` implements :class:`flowlift.local_engine.base.Engine` without a
model: deterministic outputs (:func:`default_responder`: the first label, a minimal JSON
instance, a short regex match, or ``"echo: "`` and the prompt), streamed in chunks,
honouring structured-output constraints, raw prompts, ``stop`` strings and
``max_tokens`` (counted in whitespace-separated words: :func:`cut`), with deterministic
logprobs and a simulated prefix cache so cached-token accounting can be tested. Its
``responder`` scripts the answers; for a model that calls tools (an agent step) it
returns :func:`tool_calls_text`.

:func:`capture_spans` records flowlift's OpenTelemetry spans in memory while it is
active (like ``structlog.testing.capture_logs``); ``CapturedSpans.named("chat m")``,
``.children(span)`` and ``.spans`` read them.

:class:`FakeBatchAPI` (from :mod:`flowlift.testing.batch`) fakes the OpenAI Batch API:
files, batches, time-scaled turnaround, partial failures, expiry, malformed lines.

:class:`QwenStyleFakeEngine` (from :mod:`flowlift.testing.native`) is a FakeEngine that
takes ``tools`` in a Qwen-style format read by vLLM's ``hermes`` parser (needs vLLM).

:mod:`flowlift.testing.openai` is a fake OpenAI provider (chat for the standard and flex
tiers, the Batch API), runnable as ``python -m flowlift.testing.openai``.
"""

from flowlift.testing.batch import (
    MALFORMED,
    FakeBatchAPI,
    LineError,
    echo_responder,
    fixed_turnaround,
    lognormal_turnaround,
)
from flowlift.testing.engine import (
    FakeEngine,
    FakeEngineWithCore,
    SeenPrompts,
    cut,
    default_responder,
    example_for_pattern,
    example_for_schema,
    fake_logprob,
    fake_tokens,
    free_port,
    idle_core,
    parse_sse,
    piece_id,
    running_proxy,
    tool_calls_text,
)
from flowlift.testing.native import QwenStyleFakeEngine
from flowlift.tracing.spans import CapturedSpans, capture_spans

__all__ = [
    "MALFORMED",
    "CapturedSpans",
    "FakeBatchAPI",
    "FakeEngine",
    "FakeEngineWithCore",
    "LineError",
    "QwenStyleFakeEngine",
    "SeenPrompts",
    "capture_spans",
    "cut",
    "default_responder",
    "echo_responder",
    "example_for_pattern",
    "example_for_schema",
    "fake_logprob",
    "fake_tokens",
    "fixed_turnaround",
    "free_port",
    "idle_core",
    "lognormal_turnaround",
    "parse_sse",
    "piece_id",
    "running_proxy",
    "tool_calls_text",
]
