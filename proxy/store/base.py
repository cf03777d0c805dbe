"""The run store's contract and the records it keeps, shared by its SQLite
(:mod:`.sqlite`) and PostgreSQL (:mod:`.postgres`) halves: both import this module and
neither imports the other (:func:`flowlift.proxy.store.location.open_store` picks one).

:class:`RunStoreProtocol` is the contract every store keeps (tests/test_store_contract.py
runs one suite over both).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from flowlift.proxy.store.events import Event
from flowlift.proxy.store.wakeups import Wakeups

SCHEMA_VERSION = 2
"""The stores' schema version (SQLite ``user_version``; Postgres ``flowlift_meta``).
2: ``run_id`` is the run's key, :func:`~flowlift.proxy.tenants.run_key` (ids per tenant)."""


def per_tenant_keys(runs: str, tables: Collection[str], mark: str) -> list[str]:
    """The statements of migration 1 -> 2: a named tenant's runs (not the default's) move
    from key ``<id>`` to ``<tenant>/<id>``, in ``runs`` and every table of ``tables``
    (keyed by ``run_id`` too). ``mark``: the SQL placeholder (``?`` or ``%s``) each
    statement takes :data:`~flowlift.proxy.tenants.DEFAULT_TENANT` for, once. Keys that
    hold a ``/`` already are left alone, so the statements may run twice."""
    moved = (f"SELECT run_id FROM {runs} WHERE tenant IS NOT NULL AND tenant <> {mark} "
             "AND strpos(run_id, '/') = 0")
    return [*(f"UPDATE {table} AS t SET run_id = (SELECT r.tenant || '/' || r.run_id FROM "
              f"{runs} r WHERE r.run_id = t.run_id) WHERE t.run_id IN ({moved})"
              for table in tables),
            f"UPDATE {runs} SET run_id = tenant || '/' || run_id WHERE run_id IN ({moved})"]


@dataclass(frozen=True, slots=True)
class StoredRun:
    run_id: str
    graph: dict[str, Any]
    status: str
    events: list[Event]
    tenant: str | None = None

    def outputs(self) -> dict[str, Any]:
        """Step id -> output (a skipped step's default included)."""
        return {d["step_id"]: d["value"] for _, n, d in self.events
                if n == "step.finished" or (n == "step.skipped" and "value" in d)}

    def failures(self) -> dict[str, str]:
        return {d["step_id"]: d["error"] for _, n, d in self.events if n == "step.failed"}

    def skipped(self) -> dict[str, str]:
        """Step id -> why it was skipped (``step.skipped``: not a failure)."""
        return {d["step_id"]: str(d.get("reason", "")) for _, n, d in self.events
                if n == "step.skipped"}

    def prompts(self) -> dict[str, list[dict[str, str]]]:
        """Step id -> the messages its model received (``step.prompt`` events), each
        ``{"role", "content"}``."""
        return {d["step_id"]: d["messages"] for _, n, d in self.events if n == "step.prompt"}


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One row of :meth:`RunStoreProtocol.recent`: a run without its events (times: epoch s)."""

    run_id: str
    name: str
    status: str
    created_at: float
    updated_at: float

    def to_json(self) -> dict[str, Any]:
        """The run as an item of ``GET /v1/workflows``."""
        return {"object": "workflow.run", "id": self.run_id, "name": self.name,
                "status": self.status, "created_at": self.created_at,
                "updated_at": self.updated_at}


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored Responses API turn (times: epoch s).

    Attributes:
        tenant: whose it is (None: the anonymous tenant).
        conversation: the id of the conversation's first response (its run and affinity).
        body: the response object, its input items and the conversation's messages
            (:mod:`flowlift.proxy.openai.responses.store` owns the shape).
    """

    tenant: str | None
    conversation: str
    body: dict[str, Any]
    created_at: float
    expires_at: float


class RunStoreProtocol(Protocol):
    """What the proxy asks of a run store (SQLite or PostgreSQL).

    Guarantees: ``create`` and ``append`` are durable (committed) when they return, so a
    run id is stored before it is returned and an event before any client sees it; a
    second store object on the same database sees everything at once. Times: epoch s.
    """

    @property
    def path(self) -> str:
        """Where the store is: a file, ``":memory:"``, or a URL without its password."""
        ...

    def create(self, run_id: str, graph: dict[str, Any], tenant: str | None = None,
               owner: str | None = None, ttl_s: float = 0.0) -> None:
        """Store a new run (status ``running``) with its graph's wire form and the tenant
        that started it (None: the anonymous one); ``owner``: the proxy that will run it,
        whose lease of ``ttl_s`` seconds a shared store takes in the same transaction (no
        other replica ever sees the new run unowned and claims it as an orphan).

        Raises:
            Exception: the database's own error when ``run_id`` exists or it fails.
        """
        ...

    def append(self, run_id: str, seq: int, name: str, data: dict[str, Any],
               epoch: int | None = None) -> None:
        """Store event ``seq`` of a run (again: replaces it); ``run.finished`` also sets
        the run's status (``data["status"]``, default ``finished``). ``epoch``: the
        writer's lease epoch (from :meth:`claim`; None: unfenced).

        Raises:
            LeaseLost: a shared store where the run's lease is not at ``epoch`` any more
                (another proxy took it over); nothing was written.
        """
        ...

    def exists(self, run_id: str) -> bool:
        """Whether the store holds the run ``run_id``."""
        ...

    def load(self, run_id: str) -> StoredRun | None:
        """The run with its events in ``seq`` order, or None when there is none."""
        ...

    def recent(self, *, status: str | None = None, name: str | None = None, limit: int = 20,
               after: str | None = None, since: float | None = None,
               tenant: str | None = None) -> tuple[list[RunSummary], bool]:
        """Runs newest first, filtered and paged (see :meth:`SQLiteRunStore.recent`).

        Returns:
            Up to ``limit`` runs and whether more follow.
        """
        ...

    def unfinished(self) -> list[StoredRun]:
        """Every run still ``running``, oldest first."""
        ...

    def prune(self, older_than_s: float, keep: int | None = None) -> int:
        """Forget old finished runs (see :meth:`SQLiteRunStore.prune`).

        Returns:
            How many runs were forgotten.
        """
        ...

    def problem(self) -> str | None:
        """Why the store cannot take writes now, or None."""
        ...

    def close(self) -> None:
        """Release the database (the object is unusable after)."""
        ...

    @property
    def trouble(self) -> str | None:
        """Why the store's last call failed, while it fails (the database is unreachable,
        restarting, out of connections: calls are retried meanwhile), or None."""
        ...

    def listener(self) -> Wakeups:
        """What announces this store's changes to the proxy's waiters: a LISTEN channel
        on a shared store, else plain polling (:mod:`~flowlift.proxy.store.wakeups`)."""
        ...

    # -- ownership: which proxy executes a run (leases; see store_pg) ------------------
    @property
    def shared(self) -> bool:
        """Whether several proxies may use the database at once (leases are then real;
        a store one proxy owns grants every claim)."""
        ...

    def claim(self, run_id: str, owner: str, ttl_s: float) -> int | None:
        """Take (or renew) the lease of ``run_id`` for ``owner`` for ``ttl_s`` seconds:
        granted when nobody holds it, its holder's lease expired, or ``owner`` holds it.

        Returns:
            The lease's epoch (>= 1, the fencing token :meth:`append` takes; a new owner
            gets a greater one than any before, a renewal keeps it) when ``owner`` holds
            the lease now, else None.
        """
        ...

    def renew(self, owner: str, run_ids: Collection[str], ttl_s: float) -> set[str]:
        """Extend ``owner``'s leases of ``run_ids`` by ``ttl_s`` from now (the heartbeat).

        Returns:
            The ids ``owner`` still holds (a run taken over by another is left out).
        """
        ...

    def release(self, run_id: str, owner: str) -> None:
        """Give up ``owner``'s lease of ``run_id`` (nothing when another holds it)."""
        ...

    def orphans(self, owner: str) -> list[str]:
        """Ids of the runs still ``running`` that ``owner`` could claim (no lease, an
        expired one, or its own), oldest first."""
        ...

    # -- a tool result posted to any proxy; runs followed from another proxy ----------
    def put_tool_result(self, run_id: str, step_id: str, body: dict[str, Any]) -> bool:
        """Keep a ``@tool`` step's result (``{"value"}`` or ``{"error"}``) until the run's
        owner consumes it (the first post wins).

        Returns:
            True when stored now, False when the step had a result already.
        """
        ...

    def tool_results(self, run_id: str, step_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        """The kept results of ``step_ids`` of ``run_id`` (step id -> body)."""
        ...

    def mark_followed(self, run_ids: Collection[str]) -> None:
        """Say (now) that a client follows these runs through this proxy."""
        ...

    def followed(self, run_ids: Collection[str], within_s: float) -> set[str]:
        """The ids among ``run_ids`` marked followed within the last ``within_s`` s."""
        ...

    def put_request(self, run_id: str, kind: str, body: dict[str, Any]) -> int:
        """Keep a request for the proxy that executes ``run_id`` (``kind``: ``"nodes"``,
        an open run's append; ``"close"``; ``"cancel"``).

        Returns:
            Its id (ids grow in the order requests were kept).
        """
        ...

    def requests(self, run_ids: Collection[str]) -> list[tuple[int, str, str, dict[str, Any]]]:
        """Kept requests of ``run_ids`` as ``(id, run_id, kind, body)``, oldest first."""
        ...

    def drop_requests(self, ids: Collection[int]) -> None:
        """Forget requests that were carried out."""
        ...

    def put_response(self, response_id: str, row: StoredResponse) -> None:
        """Store (or replace) one Responses API response: durable when it returns."""
        ...

    def get_response(self, response_id: str) -> StoredResponse | None:
        """The stored response ``response_id`` unless missing or expired (any tenant's:
        the caller checks ``tenant``)."""
        ...

    def delete_response(self, response_id: str) -> bool:
        """Forget one stored response; whether it was there."""
        ...

    def prune_responses(self, keep: int) -> int:
        """Forget expired responses and all but the ``keep`` newest; how many went."""
        ...
