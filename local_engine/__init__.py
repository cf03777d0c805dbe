"""The embedded inference engine: one interface, a vLLM implementation.

The vLLM implementation lives in :mod:`flowlift.local_engine.vllm_engine` and imports
vLLM only when it starts, so the rest of flowlift works without vLLM installed.
"""

from flowlift.local_engine.base import (
    Capabilities,
    ChatMessage,
    Engine,
    GenerationChunk,
    GenerationRequest,
    OutputConstraint,
    SamplingOptions,
    Usage,
)

__all__ = [
    "Capabilities",
    "ChatMessage",
    "Engine",
    "GenerationChunk",
    "GenerationRequest",
    "OutputConstraint",
    "SamplingOptions",
    "Usage",
]
