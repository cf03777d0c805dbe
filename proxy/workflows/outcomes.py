"""Learned failure rates per (step name, model), persisted next to the run store.

Every llm step reports, for each model it tried, whether that model delivered the
output and how many attempts it took (:func:`flowlift.proxy.workflows.cascade.run_step`). The
counts live in one small SQLite table in the state database (``--state-db``), so they
survive restarts and the compiler's cascade estimate
(:mod:`flowlift.escalation`) gets better with every run::

    step_outcomes(step TEXT, model TEXT, items INTEGER, failures INTEGER,
                  attempts INTEGER, updated_at REAL, PRIMARY KEY (step, model))

Output lengths per (step, model) live beside them: the completion tokens of the last
:data:`KEEP_LENGTHS` outputs each step delivered (a JSON list), from which the compiler
takes the median (p50) as the step's expected output length (p90 is reported too)::

    step_output_tokens(step TEXT, model TEXT, tokens TEXT, updated_at REAL,
                       PRIMARY KEY (step, model))

Steps are keyed by their name (``@step`` function name, e.g. ``extract``), not their
id, so all items of a batch pool their counts; models by the name the graph uses
(``small``, ``large``), so two aliases of one served model keep separate rates.
"""

from __future__ import annotations

import json
import math
import sqlite3
import statistics
import time
from collections import deque
from pathlib import Path

from flowlift.compiler import OutputLengths
from flowlift.errors import EngineError
from flowlift.escalation import OutcomeCounts
from flowlift.tracing import get_logger

log = get_logger("flowlift.outcomes")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS step_outcomes (step TEXT NOT NULL, model TEXT NOT NULL,
    items INTEGER NOT NULL, failures INTEGER NOT NULL, attempts INTEGER NOT NULL,
    updated_at REAL NOT NULL, PRIMARY KEY (step, model));
CREATE TABLE IF NOT EXISTS step_output_tokens (step TEXT NOT NULL, model TEXT NOT NULL,
    tokens TEXT NOT NULL, updated_at REAL NOT NULL, PRIMARY KEY (step, model));
"""
KEEP_LENGTHS = 200
_UPSERT = """
INSERT INTO step_outcomes VALUES (?, ?, 1, ?, ?, ?)
ON CONFLICT (step, model) DO UPDATE SET items = items + 1,
    failures = failures + excluded.failures, attempts = attempts + excluded.attempts,
    updated_at = excluded.updated_at
"""


class StepOutcomes:
    """Counts per (step, model), read once at start and written through on each record.

    Args:
        path: the SQLite file (the proxy's state database) or ``":memory:"``.
        default_model: the name recorded for steps that name no model.

    Raises:
        EngineError: when the database cannot be opened (the message names the path).
    """

    def __init__(self, path: str | Path = ":memory:", *, default_model: str | None = None
                 ) -> None:
        self.path = str(path)
        self.default_model = default_model or "default"
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None,
                                       check_same_thread=False, timeout=5.0)
            self._db.executescript(_SCHEMA)
            rows = self._db.execute(
                "SELECT step, model, items, failures, attempts FROM step_outcomes").fetchall()
            lengths = self._db.execute(
                "SELECT step, model, tokens FROM step_output_tokens").fetchall()
        except sqlite3.Error as exc:
            raise EngineError(f"cannot open the outcome store {self.path}: {exc}") from exc
        self._counts = {(s, m): OutcomeCounts(i, f, a) for s, m, i, f, a in rows}
        self._lengths: dict[tuple[str, str], deque[int]] = {
            (s, m): deque(json.loads(t), maxlen=KEEP_LENGTHS) for s, m, t in lengths}

    def record(self, step: str, model: str | None, accepted: bool, attempts: int) -> None:
        """One item of ``step`` ran on ``model``: delivered (``accepted``) or not."""
        key = (step, model or self.default_model)
        old = self._counts.get(key, OutcomeCounts())
        failed = 0 if accepted else 1
        self._counts[key] = OutcomeCounts(old.items + 1, old.failures + failed,
                                          old.attempts + attempts)
        try:
            self._db.execute(_UPSERT, (*key, failed, attempts, time.time()))
        except sqlite3.Error as exc:  # advisory counts: a busy database never fails a step
            log.warning("outcome_store_write_failed", path=self.path, error=str(exc))

    def record_output(self, step: str, model: str | None, completion_tokens: int) -> None:
        """``step`` delivered an output of ``completion_tokens`` tokens on ``model``."""
        key = (step, model or self.default_model)
        kept = self._lengths.setdefault(key, deque(maxlen=KEEP_LENGTHS))
        kept.append(int(completion_tokens))
        try:
            self._db.execute("INSERT OR REPLACE INTO step_output_tokens VALUES (?, ?, ?, ?)",
                             (*key, json.dumps(list(kept)), time.time()))
        except sqlite3.Error as exc:  # advisory, as the counts
            log.warning("outcome_store_write_failed", path=self.path, error=str(exc))

    def lengths(self, step: str, model: str | None) -> OutputLengths | None:
        """The output lengths ``step`` had on ``model`` (tokens), or None when never seen."""
        kept = self._lengths.get((step, model or self.default_model))
        if not kept:
            return None
        ordered = sorted(kept)
        p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
        return OutputLengths(len(ordered), float(statistics.median(ordered)), float(p90))

    def counts(self, step: str, model: str | None) -> OutcomeCounts:
        """What ``step`` did on ``model`` so far (zero counts when never seen)."""
        return self._counts.get((step, model or self.default_model), OutcomeCounts())

    def snapshot(self) -> dict[tuple[str, str], OutcomeCounts]:
        return dict(self._counts)

    def close(self) -> None:
        self._db.close()
