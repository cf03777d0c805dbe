"""Document chains under KV pressure (issue 35 §5, P12): a pipeline of three steps per
document, each re-reading the document's text, through the real slot queue
(:class:`PrioritySlots`, the priorities a run gives: remaining critical path, the run as
the program) on a fake engine with a KV-capacity model (an LRU prefix cache of whole
documents, running requests pinned, as vLLM's prefix cache keeps freed blocks).

Without chains the critical path starts every document's first step before any
second step (breadth-first, like a stage-by-stage client), so on a cache a third of
the corpus each document is evicted before its next step and prefilled again; with
the run's chains as working-set sessions, a new document starts only while those
started fit, and their next steps find their text cached."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict

from flowlift.proxy.dispatch.slots.policy import SlotPolicy
from flowlift.proxy.dispatch.slots.scheduler import Priority, PrioritySlots
from flowlift.proxy.dispatch.slots.working_set import WorkingSetConfig

STAGES = 3


class KvEngine:
    """Prefix cache of ``capacity`` tokens: document -> its cached prefix, least
    recently used evicted first; a running request's tokens are pinned."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cache: OrderedDict[int, int] = OrderedDict()
        self.pinned: dict[int, int] = {}
        self.prompt = self.cached = 0

    def _evict(self) -> None:
        while self.cache and sum(self.pinned.values()) + sum(self.cache.values()) \
                > self.capacity:
            self.cache.popitem(last=False)

    def start(self, doc: int, prompt: int) -> int:
        """Tokens the request must prefill (those its cached prefix does not cover)."""
        hit = min(self.cache.pop(doc, 0), prompt)
        self.prompt += prompt
        self.cached += hit
        self.pinned[doc] = prompt
        self._evict()
        return prompt - hit

    def finish(self, doc: int, tokens: int) -> None:
        self.pinned.pop(doc)
        self.cache[doc] = tokens
        self._evict()


class Frozen:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def pipeline(chains: bool, *, docs: int = 24, doc_tokens: int = 400,
                   capacity: int = 3200, slots: int = 8) -> tuple[KvEngine, PrioritySlots]:
    engine = KvEngine(capacity)
    policy = SlotPolicy(reserved_interactive=0,
                        working_set=WorkingSetConfig(chains=chains, target=1.0))
    pool = PrioritySlots(slots, policy, timer=Frozen(), kv_capacity=lambda: capacity)

    async def chain(doc: int) -> None:
        for stage in range(STAGES):
            p = dataclasses.replace(  # the run's priority: remaining path, its chain
                Priority.of("interactive", 100.0 * (STAGES - stage), program="run"),
                kv_group=f"run#{doc}")
            async with pool.slot(p) as slot:
                prompt = doc_tokens + 20 * stage  # the text, then earlier answers
                for _ in range(1 + engine.start(doc, prompt) // 50):  # prefill time
                    await asyncio.sleep(0)
                engine.finish(doc, prompt + 20)
                pool.observed(slot.priority, prompt + 20)
        pool.ended(p)

    await asyncio.gather(*(chain(d) for d in range(docs)))
    return engine, pool


async def test_chains_keep_a_documents_steps_while_its_text_is_cached():
    flat, _ = await pipeline(chains=False)
    kept, pool = await pipeline(chains=True)
    flat_re, kept_re = flat.prompt - flat.cached, kept.prompt - kept.cached
    assert flat.prompt == kept.prompt
    assert flat.cached / flat.prompt < 0.2  # breadth-first: every stage re-prefills
    assert kept.cached / kept.prompt > 0.6  # stages 2 and 3 hit the document's text
    assert kept_re < 0.5 * flat_re
    assert pool.working.held > 0  # new documents waited at the door
    assert pool.working.members() == {}  # every chain left when its last step did


async def test_without_pressure_chains_hold_nothing():
    flat, _ = await pipeline(chains=False, capacity=100_000)
    kept, pool = await pipeline(chains=True, capacity=100_000)
    assert pool.working.held == 0
    assert kept.cached == flat.cached == 24 * sum(400 + 20 * (s - 1) + 20
                                                  for s in range(1, STAGES))


def test_the_working_set_follows_the_chain_only_when_told():
    kv = dataclasses.replace(Priority.of("batch", program="run"), kv_group="run#a")
    on = PrioritySlots(2, SlotPolicy(working_set=WorkingSetConfig()))
    off = PrioritySlots(2, SlotPolicy(working_set=WorkingSetConfig(chains=False)))
    assert on._kv(kv) == "run#a" and off._kv(kv) == "run"
    assert on._kv(Priority.of("batch", program="run")) == "run"


async def test_a_runs_steps_reach_the_working_set_as_their_document_chains():
    from flowlift.compiler import CompileOptions, compile_graph
    from flowlift.graph import Graph
    from flowlift.proxy.dispatch.backends import Backends
    from flowlift.proxy.dispatch.settings import DispatchSettings
    from flowlift.proxy.workflows.runs import Run
    from flowlift.testing import FakeEngine

    def llm(nid: str, doc: str, ref: str | None = None) -> dict[str, object]:
        parts: list[dict[str, object]] = [{"text": f"{doc}\nTask {nid}: "}]
        if ref is not None:
            parts.append({"ref": ref})
        return {"kind": "llm", "id": nid, "messages": [{"role": "user", "content": parts}]}

    docs = {d: " ".join(f"doc{d}-word{i}" for i in range(120)) for d in (0, 1)}
    graph = Graph.model_validate({"nodes": [
        node for d, text in docs.items()
        for node in (llm(f"a{d}", text), llm(f"b{d}", text, f"a{d}"),
                     llm(f"c{d}", text, f"b{d}"))]})
    backends = Backends({"m": FakeEngine(["m"])},
                        DispatchSettings(working_set=WorkingSetConfig()))
    working = backends.backends[0].slots.working
    seen: list[str | None] = []
    started = working.started
    working.started = lambda program: (seen.append(program), started(program))[1]  # type: ignore[method-assign]
    run = Run(graph, backends, compile_graph(graph, CompileOptions(default_model="m")))
    await run.start()
    assert run.trace.status == "succeeded"
    key = run.key
    assert sorted(seen) == sorted([f"{key}#a0"] * 3 + [f"{key}#a1"] * 3)
    assert working.members() == {}  # each chain left once its last step ended
