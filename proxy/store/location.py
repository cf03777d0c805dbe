"""Which run store ``--state-db`` names: a ``postgresql://`` (or ``postgres://``) URL
opens a :class:`~flowlift.proxy.store.postgres.PostgresRunStore` (several proxies on one
database), anything else a :class:`~flowlift.proxy.store.sqlite.SQLiteRunStore` file
(``":memory:"``: none). Above both halves, so that neither imports the other."""

from __future__ import annotations

from pathlib import Path

from flowlift.errors import EngineError
from flowlift.proxy.store.base import RunStoreProtocol
from flowlift.proxy.store.sqlite import SQLiteRunStore


def is_database_url(location: str | Path | None) -> bool:
    """Whether a ``--state-db`` value names a PostgreSQL server (``postgresql://`` or
    ``postgres://``) rather than a SQLite file."""
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def open_store(location: str | Path = ":memory:") -> RunStoreProtocol:
    """The run store ``--state-db`` names: a PostgreSQL URL, a SQLite file or ``":memory:"``.

    Raises:
        EngineError: the database cannot be opened or reached (the message names it), or
            ``location`` is a URL of another kind (``mysql://``...).
    """
    if isinstance(location, str) and "://" in location and not is_database_url(location):
        raise EngineError(f"--state-db {location.split('://')[0]}://...: a run store is a "
                          "SQLite file or a postgresql:// URL")
    if is_database_url(location):
        from flowlift.proxy.store.postgres import PostgresRunStore

        return PostgresRunStore(str(location))
    return SQLiteRunStore(location)
