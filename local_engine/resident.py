"""One model under a residency manager, seen as an ordinary :class:`Engine`.

The proxy dispatches to engines (:class:`flowlift.proxy.dispatch.backends.Backends`); it should not
care whether a model is loaded. :class:`ResidentEngine` wraps one model of a
:class:`~flowlift.local_engine.residency.ResidencyManager` (pydantic-ai's pattern: a model
wrapped, not a concern woven into every call site):

* ``generate`` first makes the model resident (unloading others as the manager decides:
  furthest next use per the compiler's plan, never a model a queued step needs or one
  with requests in flight), holds a lease for the whole stream, then delegates;
* ``start`` loads the model only if it fits without unloading anything (the proxy starts
  every engine at boot; the rest load on first use); ``close`` unloads it.

Workflow steps and OpenAI requests on a managed model take the same path, and the time a
request waits for a load is inside its engine time (prefill in a run's trace).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

from flowlift.local_engine.base import Engine, GenerationChunk, GenerationRequest
from flowlift.local_engine.residency import ResidencyManager
from flowlift.local_engine.step_log import StepLog


class ResidentEngine(Engine):
    """``model`` of ``manager``, loaded on demand.

    Raises (from :meth:`generate`): :class:`flowlift.errors.EngineError` when the model
    cannot be made resident (see :meth:`ResidencyManager.ensure`), and whatever the
    wrapped engine raises.
    """

    def __init__(self, manager: ResidencyManager, model: str) -> None:
        self.manager = manager
        self.model = model
        self.inner = manager.models[model].engine
        self.capabilities = self.inner.capabilities

    @property
    def model_names(self) -> Sequence[str]:
        return self.inner.model_names

    @property
    def resident(self) -> bool:
        return self.model in self.manager.resident

    async def start(self) -> None:
        await self.manager.preload(self.model)

    async def close(self) -> None:
        await self.manager.unload(self.model)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        async with self.manager.use(self.model) as engine:
            stream = engine.generate(request)
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                await stream.aclose()

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def healthy(self) -> bool:
        """A model that is not loaded is healthy: it loads on the next request."""
        return await self.inner.healthy() if self.resident else True

    def running(self) -> int | None:
        return (self.inner.running() or 0) if self.resident else 0

    def tokenize(self, model: str, text: str) -> list[int] | None:
        return self.inner.tokenize(model, text)

    def step_log(self) -> StepLog | None:
        return self.inner.step_log()


def managed_engines(manager: ResidencyManager) -> dict[str, Engine]:
    """Served model name -> :class:`ResidentEngine`, for every model of ``manager`` (the
    mapping :func:`flowlift.proxy.create_app` takes)."""
    return {name: ResidentEngine(manager, name) for name in manager.models}
