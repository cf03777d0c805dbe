"""This proxy's leases on the runs it executes (replicas on one shared store).

Each run is held by one proxy at a time: a lease with a time to live (``ttl_s``),
renewed by the holder's heartbeat, and an epoch that rises at every claim. Every event a
run writes carries its holder's epoch, and the store refuses a write with an older one
(fencing tokens, Kleppmann's "How to do distributed locking"): a proxy that lost a run
cannot write into it after another took it over. :class:`Leases` keeps this proxy's
name and the epochs of the runs it holds; its store calls run on the store's worker
thread (:class:`~flowlift.proxy.store.worker.StoreWorker`).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Collection
from typing import Any

from flowlift.proxy.store.base import RunStoreProtocol, StoredRun


class Leases:
    """This proxy's owner name and lease epochs.

    Args:
        store: the run store (SQLite leases always succeed; PostgreSQL's are shared).
        ttl_s: seconds a lease lasts unrenewed before another proxy may take the run.

    Attributes:
        owner: ``host:pid:random``, this proxy's name in the store's lease rows.
        epochs: run key -> this proxy's lease epoch on it (fencing its writes).
    """

    def __init__(self, store: RunStoreProtocol, ttl_s: float = 15.0) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.epochs: dict[str, int] = {}

    def epoch(self, key: str) -> int:
        """The epoch this proxy writes ``key``'s events with; 0 (no lease has it: the
        write is refused, failing closed) when it holds none."""
        return self.epochs.get(key, 0)

    def create(self, key: str, wire: dict[str, Any], tenant: str | None) -> int | None:
        """On the store's worker: create the run ``key`` held by this proxy and claim it.

        Returns:
            Its lease epoch (None: a stranger's lease on a fresh id; its writes fail).
        """
        self.store.create(key, wire, tenant, owner=self.owner, ttl_s=self.ttl_s)
        return self.store.claim(key, self.owner, self.ttl_s)  # (ours: its epoch)

    def claim_orphans(self, mine: Collection[str]) -> list[tuple[int, StoredRun]]:
        """On the store's worker: claim the unfinished runs nobody holds (leaving out
        ``mine``, running here) and load each after its claim.

        Returns:
            ``(epoch, run)`` of each run claimed.
        """
        claimed = []
        for run_id in self.store.orphans(self.owner):
            if run_id in mine:
                continue
            epoch = self.store.claim(run_id, self.owner, self.ttl_s)
            stored = None if epoch is None else self.store.load(run_id)  # after the claim
            if epoch is not None and stored is not None:  # (else another's, or pruned)
                claimed.append((epoch, stored))
        return claimed

    def renew(self, keys: list[str]) -> set[str]:
        """On the store's worker: renew the leases of ``keys``; those still held."""
        return self.store.renew(self.owner, keys, self.ttl_s)

    def release(self, key: str) -> None:
        """On the store's worker: give ``key``'s lease up (its run ended or stopped here)."""
        self.store.release(key, self.owner)
