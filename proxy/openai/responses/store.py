"""Stored Responses API turns: what ``previous_response_id`` continues, in the proxy's run
store (``responses`` table of :mod:`flowlift.proxy.store.sqlite`: SQLite or
PostgreSQL, so a conversation outlives a restart and any proxy on a shared database can
continue it).

Each stored turn keeps its response object, its input items and the conversation's
chat messages up to and including its answer (instructions excluded: as OpenAI's, they
are not carried over), so a turn needs one read whatever the conversation's length, and
deleting a turn leaves later turns usable. Bounded and expiring like sessions: each turn
lives ``ttl_s`` after it was stored, and at most ``max_responses`` are kept (the oldest
go first; pruned every :data:`PRUNE_EVERY` stores). A response is visible only to the
tenant that created it; to any other it does not exist (404).

A client waits on every call here, so each is bounded as the run routes' are: a store
that finishes no call for :data:`ANSWER_WITHIN_S` (a database outage: the PostgreSQL
store retries inside its calls for up to a minute) answers
:class:`~flowlift.errors.StoreUnavailable` (503 ``store_unavailable``, ``Retry-After``)
instead of holding the client for the whole outage (issue 38, item 13).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from flowlift.errors import ResponseNotFound
from flowlift.proxy.store.base import RunStoreProtocol, StoredResponse
from flowlift.proxy.store.worker import StoreWorker
from flowlift.proxy.tenants import visible

PRUNE_EVERY = 64
ANSWER_WITHIN_S = 3.0
"""Seconds a client waits on a store that finishes no call (the run routes' bound,
``flowlift.proxy.workflows.registry.ANSWER_WITHIN_S``) before its 503."""


@dataclass(frozen=True, slots=True)
class Turn:
    """A stored turn as the next one reads it.

    Attributes:
        conversation: the id of the conversation's first response (run id, affinity).
        messages: chat messages of the whole conversation up to this turn's answer.
        number: this turn's number in its conversation (1 for the first).
    """

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: str
    messages: list[dict[str, Any]]
    number: int


class ResponseStore:
    """The stored turns of every conversation (see the module docstring).

    Args:
        runs: the proxy's run store.
        ttl_s: seconds a stored response lives.
        max_responses: responses kept at most.
    """

    def __init__(self, runs: RunStoreProtocol, *, io: StoreWorker | None = None,
                 ttl_s: float = 86_400.0, max_responses: int = 10_000) -> None:
        self.runs, self.ttl_s, self.max_responses = runs, ttl_s, max_responses
        self.io = io if io is not None else StoreWorker()
        self._stored = 0

    async def save(self, turn: Turn, tenant: str | None) -> None:
        """Store ``turn`` under its response's id (durable when it returns; on the
        store's worker thread, in order with the run store's other calls).

        Raises:
            StoreUnavailable: the store did not answer in time (see the module).
        """
        now = time.time()
        body = {"response": turn.response, "input_items": turn.input_items,
                "messages": turn.messages, "number": turn.number}
        await self.io.call(self.runs.put_response, turn.response["id"], StoredResponse(
            tenant, turn.conversation, body, now, now + self.ttl_s), within_s=ANSWER_WITHIN_S)
        self._stored += 1
        if self._stored % PRUNE_EVERY == 0:
            self.io.submit(self.runs.prune_responses, self.max_responses)

    async def load(self, response_id: str, tenant: str | None, *, param: str | None = None
             ) -> Turn:
        """The stored turn ``response_id`` as ``tenant`` sees it.

        Raises:
            ResponseNotFound: none, expired, deleted or another tenant's (404 naming
                ``param``).
            StoreUnavailable: the store did not answer in time (see the module).
        """
        row = await self.io.call(self.runs.get_response, response_id, within_s=ANSWER_WITHIN_S)
        if row is None or not visible(row.tenant, tenant):
            raise ResponseNotFound(response_id, param=param)
        body = row.body
        return Turn(body["response"], body["input_items"], row.conversation,
                    body["messages"], int(body["number"]))

    async def delete(self, response_id: str, tenant: str | None) -> None:
        """Forget one stored turn.

        Raises:
            ResponseNotFound: none that ``tenant`` can see.
            StoreUnavailable: the store did not answer in time (see the module).
        """
        await self.load(response_id, tenant, param="response_id")
        await self.io.call(self.runs.delete_response, response_id, within_s=ANSWER_WITHIN_S)


RESPONSES: web.AppKey[ResponseStore] = web.AppKey("flowlift.responses", ResponseStore)
