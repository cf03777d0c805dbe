"""Outcome writes (``proxy/store/outcomes.py``): coalesced per (step, model) on the
writer thread, never dropped. Found while fixing the 1,000-run burst: the old writer
queued one write per step and dropped writes past 1,000 waiting, so a burst on a busy
machine lost learned counts from the database."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

from flowlift.proxy.store.outcomes import StepOutcomes


def _hold_writes(outcomes: StepOutcomes) -> tuple[threading.Event, list[str]]:
    """Every statement waits for the returned event (a database that stalls); the
    statements run are listed."""
    gate, ran = threading.Event(), []
    real = outcomes._db.execute

    def slow(text: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        gate.wait(10.0)
        ran.append(text.split("(")[0].strip())
        return real(text, params)

    outcomes._db.execute = slow  # type: ignore[method-assign]
    return gate, ran


def test_a_burst_on_a_stalled_database_is_written_whole_in_a_few_upserts(
        tmp_path: Path) -> None:
    outcomes = StepOutcomes(tmp_path / "state.sqlite")
    gate, ran = _hold_writes(outcomes)
    for i in range(3000):  # past the 1,000 writes the old writer dropped beyond
        outcomes.record("classify", "small", accepted=i % 3 != 0, attempts=1 + i % 2)
        outcomes.record_output("classify", "small", 10 + i % 7)
    gate.set()
    outcomes.close()
    assert len(ran) <= 4, "one flush waited while the burst came: at most two of each"
    rows = sqlite3.connect(tmp_path / "state.sqlite").execute(
        "SELECT items, failures, attempts FROM step_outcomes").fetchall()
    assert rows == [(3000, 1000, 4500)]
    again = StepOutcomes(tmp_path / "state.sqlite")
    assert again.counts("classify", "small") == outcomes.counts("classify", "small")
    assert again.lengths("classify", "small") == outcomes.lengths("classify", "small")
    again.close()


def test_a_failed_write_is_kept_and_goes_with_the_next(tmp_path: Path) -> None:
    outcomes = StepOutcomes(tmp_path / "state.sqlite")
    real, failing = outcomes._db.execute, [True]

    def flaky(text: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if failing[0]:
            raise sqlite3.OperationalError("database is locked")
        return real(text, params)

    outcomes._db.execute = flaky  # type: ignore[method-assign]
    outcomes.record("extract", "large", accepted=True, attempts=1)
    outcomes.record_output("extract", "large", 42)
    outcomes._writer.submit(lambda: None).result(5)  # (the failed flush has run)
    failing[0] = False
    outcomes.record("extract", "large", accepted=False, attempts=2)
    outcomes.close()
    reopened = StepOutcomes(tmp_path / "state.sqlite")
    counts = reopened.counts("extract", "large")
    assert (counts.items, counts.failures, counts.attempts) == (2, 1, 3)
    lengths = reopened.lengths("extract", "large")
    assert lengths is not None and lengths.samples == 1 and lengths.p50 == 42
    reopened.close()
