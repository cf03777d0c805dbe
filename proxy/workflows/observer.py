"""Who watches a workflow run start and end: :class:`RunObserver`.

The proxy's telemetry (:class:`flowlift.proxy.telemetry.observer.Telemetry`: the run's
span, its steps' spans, the metrics) is one; :data:`NO_OBSERVER` watches nothing (a
:class:`~flowlift.proxy.workflows.registry.RunRegistry` or a
:class:`~flowlift.proxy.workflows.runs.Run` built without telemetry, as in tests). The
observer is handed to the registry's constructor, which hands it to each run's.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from flowlift.proxy.workflows.runs import Run


class RunObserver(Protocol):
    """Hooks a run calls as it starts and as it closes. Neither may raise into the run."""

    def run_started(self, run: Run) -> contextvars.Context | None:
        """The context to run ``run``'s task in (e.g. with its span current), or None
        for the caller's own."""
        ...

    def run_closed(self, run: Run) -> None:
        """``run`` finished (its trace is final; ``run.deadline_missed`` is set)."""
        ...


class NoObserver:
    """The :class:`RunObserver` that watches nothing: runs start in the caller's context."""

    def run_started(self, run: Run) -> contextvars.Context | None:
        return None

    def run_closed(self, run: Run) -> None:
        return None


NO_OBSERVER: RunObserver = NoObserver()
