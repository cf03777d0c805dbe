"""Record-only runs of a whole script: ``flowlift compile workflow.py`` builds the graphs
a script records without running a step.

While :func:`recording` is active, every ``workflow(...)`` the script opens records
as with ``submit=False`` (nothing is shipped to a proxy, no ``@tool`` runs) and is kept
in the :class:`Recorder`. The first read of a value that only a run could give --
``var.get()`` or ``await var`` inside the block, ``var.value`` after it -- raises
:class:`RecordingStopped`: the script ends there, cleanly, with every step recorded
before that line kept (the graph a later step would grow from a value cannot be known
without running it). Outside :func:`recording` the SDK behaves as always: with
``submit=False`` a read raises :class:`~flowlift.errors.UserError`.

The same idea as a dry run of a build tool (``make -n``): the script's own code decides
the graph, so it runs, but its effects stop at the first thing that needs a result.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flowlift.sdk.workflow import Workflow


class RecordingStopped(BaseException):
    """A record-only script read a value no run produced: recording stops here.

    A ``BaseException`` (like ``GeneratorExit``) and not a flowlift error: it is no
    mistake of the script, and an ``except Exception`` in the script must not swallow it.

    Attributes:
        step_id: the step whose value was read.
        how: the read (``".value"``, ``"var.get()"``, ``"await var"``).
    """

    def __init__(self, step_id: str, how: str) -> None:
        super().__init__(f"recording stopped at {how} of step {step_id!r}: no step runs "
                         "while the graph is only recorded")
        self.step_id = step_id
        self.how = how


@dataclass
class Recorder:
    """What a record-only script recorded: its workflows, in the order it opened them."""

    workflows: list[Workflow] = field(default_factory=list)


_lock = threading.Lock()
_active: Recorder | None = None  # process-wide: a script's threads record too


def active() -> Recorder | None:
    """The recorder while :func:`recording` is active, else None."""
    return _active


@contextmanager
def recording() -> Iterator[Recorder]:
    """Record every workflow opened in this process until the block ends, none submitted.

    Raises:
        RuntimeError: another recording is already active (one script at a time).
    """
    global _active
    with _lock:
        if _active is not None:
            raise RuntimeError("a record-only run is already active in this process")
        _active = recorder = Recorder()
    try:
        yield recorder
    finally:
        with _lock:
            _active = None


def stop(step_id: str, how: str) -> None:
    """Raise :class:`RecordingStopped` while recording; else return (the caller raises
    its own error).

    Raises:
        RecordingStopped: while :func:`recording` is active.
    """
    if _active is not None:
        raise RecordingStopped(step_id, how)


@dataclass
class Recorded:
    """A script's record-only run (:func:`record_script`).

    Attributes:
        workflows: each workflow the script opened that recorded at least one step.
        stopped: why recording stopped early (the first value read, with the script's
            line: ``"`.value` of step 'label-1' at workflow.py:12"``), or None when the
            script ran to its end.
    """

    workflows: list[Workflow]
    stopped: str | None


def record_script(path: str | os.PathLike[str], argv: Sequence[str] = ()) -> Recorded:
    """Run the Python script at ``path`` as ``__main__`` (``sys.argv`` = the path and
    ``argv``, its folder first on ``sys.path``) with every workflow record-only, and
    return what it recorded. Its stdout goes to stderr (the caller's stdout is the
    report). A script that calls ``sys.exit`` ends there.

    Raises:
        OSError: the script cannot be read.
        BaseException: whatever else the script raised (its own error), unchanged.
    """
    script = Path(path).resolve()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(script.parent))
    stopped = None
    try:
        with recording() as recorder, contextlib.redirect_stdout(sys.stderr):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except RecordingStopped as exc:
                stopped = f"{exc.how} of step {exc.step_id!r}{_where(exc, script)}"
            except SystemExit:  # the script's own exit: what it recorded stands
                pass
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return Recorded([wf for wf in recorder.workflows if wf.nodes], stopped)


def _where(exc: BaseException, script: Path) -> str:
    """`` at NAME:LINE``: the script's line that read the value (its last frame in the
    traceback), or ``""``."""
    lines = [f for f in traceback.extract_tb(exc.__traceback__)
             if Path(f.filename).resolve() == script]
    return f" at {script.name}:{lines[-1].lineno}" if lines else ""
