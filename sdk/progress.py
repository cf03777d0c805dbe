"""A progress bar for a running workflow: done / running / queued / failed step counts.

On when ``workflow(..., progress=True)`` or, with ``progress=None`` (the default), when
``$FLOWLIFT_PROGRESS`` is ``1`` (``flowlift run`` sets it for its script unless given
``--no-progress``). Drawn to stderr:

* on a terminal, one line redrawn in place (``\\r``) every ``interval_s`` (0.5 s);
* otherwise (a log file, CI, a pipe) a plain line every ``interval_s`` (10 s) when the
  counts changed, so logs stay readable; no control characters.

Both end with one final line. Done and failed counts come from the run's own events
(``step.finished`` / ``step.failed``, as the SDK receives them); running and queued
ones from polling the proxy's ``GET /v1/workflows/{run_id}/progress`` (the proxy is the
only one who knows when a step leaves its queue). Drawing never raises into the run: a
failed poll only leaves the last counts on screen.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from flowlift.sdk.workflow import Workflow

ENV = "FLOWLIFT_PROGRESS"
TTY_INTERVAL_S = 0.5
PLAIN_INTERVAL_S = 10.0


def wanted(option: bool | None) -> bool:
    """The workflow's ``progress`` option, or ``$FLOWLIFT_PROGRESS`` when it is None."""
    if option is not None:
        return option
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class Counts:
    """Steps of a run by state; ``waiting`` ones wait for their inputs."""

    total: int
    done: int = 0
    failed: int = 0
    running: int = 0
    queued: int = 0
    skipped: int = 0  # not taken (a ``when`` condition): not failed

    @property
    def waiting(self) -> int:
        return max(0, self.total - self.done - self.failed - self.skipped - self.running
                   - self.queued)


def merge(total: int, done: int, failed: int, polled: Mapping[str, int] | None,
          skipped: int = 0) -> Counts:
    """Counts from the SDK's events (done, failed, skipped) and the proxy's last poll
    (the rest), clamped so they never add up past ``total``."""
    polled = polled or {}
    left = max(0, total - done - failed - skipped)
    running = min(left, polled.get("running", 0) + polled.get("waiting_tool", 0))
    queued = min(left - running, polled.get("queued", 0))
    return Counts(total, done, failed, running, queued, skipped)


def format_line(c: Counts, elapsed_s: float, name: str = "", width: int = 24) -> str:
    """``flowlift: NAME [##>>..   ] 3/10 done, 2 running, 2 queued, 0 failed, ...``.

    Bar: ``#`` done, ``!`` failed, ``-`` skipped, ``>`` running, ``.`` queued, blank
    waiting; ``N skipped`` is shown once a step was skipped.
    """
    def cells(n: int) -> int:
        return round(width * n / c.total) if c.total else 0

    done, failed, skipped = cells(c.done), cells(c.failed), cells(c.skipped)
    running = cells(c.running)
    queued = min(cells(c.queued), max(0, width - done - failed - skipped - running))
    bar = ("#" * done + "!" * failed + "-" * skipped + ">" * running
           + "." * queued)[:width].ljust(width)
    label = f" {name}" if name else ""
    return (f"flowlift:{label} [{bar}] {c.done}/{c.total} done, {c.running} running, "
            f"{c.queued} queued, {c.failed} failed, "
            + (f"{c.skipped} skipped, " if c.skipped else "")
            + f"{c.waiting} waiting for inputs, "
            f"{elapsed_s:.1f} s")


class Progress:
    """Draws :class:`Counts` to ``stream`` (see the module docstring for the two modes)."""

    def __init__(self, name: str = "", stream: IO[str] | None = None, *,
                 tty: bool | None = None, interval_s: float | None = None) -> None:
        self.name = name
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.interval_s = interval_s if interval_s is not None else (
            TTY_INTERVAL_S if self.tty else PLAIN_INTERVAL_S)
        self.t0 = time.monotonic()
        self._last_drawn = -float("inf")
        self._last_counts: Counts | None = None
        self._width = 0

    def update(self, counts: Counts, *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last_drawn < self.interval_s:
            return
        if not final and not self.tty and counts == self._last_counts:
            return
        line = format_line(counts, now - self.t0, self.name)
        try:
            if self.tty:  # one line, never wrapped (a wrapped line cannot be redrawn)
                line = line[:max(20, shutil.get_terminal_size((120, 24)).columns - 1)]
                pad = " " * max(0, self._width - len(line))
                self.stream.write("\r" + line + pad + ("\n" if final else ""))
                self._width = len(line)
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream never breaks the run
            return
        self._last_drawn, self._last_counts = now, counts


class Tracker:
    """Joins a workflow, its proxy and a :class:`Progress`: polls and draws."""

    def __init__(self, wf: Workflow, progress: Progress | None = None) -> None:
        self.wf = wf
        self.progress = progress or Progress(wf.name)
        self.polled: dict[str, int] | None = None
        self.poll_s = min(self.progress.interval_s, 2.0)

    def counts(self) -> Counts:
        failed, skipped = self.wf.failures, self.wf.skipped
        done = sum(1 for n in self.wf.nodes if self.wf.has_output(n.id)
                   and n.id not in failed and n.id not in skipped)
        return merge(len(self.wf.nodes), done, len(failed), self.polled, len(skipped))

    def url(self) -> str | None:
        return None if self.wf.run_id is None else f"/v1/workflows/{self.wf.run_id}/progress"

    def take(self, response: httpx.Response) -> None:
        if response.status_code == 200:
            self.polled = dict(response.json().get("counts") or {})

    def draw(self, final: bool = False) -> None:
        self.progress.update(self.counts(), final=final)

    def run_thread(self, client: httpx.Client, stop: threading.Event) -> None:
        """The sync driver's poller (a thread; ``stop`` ends it)."""
        while not stop.wait(self.poll_s):
            url = self.url()
            if url is not None:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    self.take(client.get(url, timeout=5.0))
            self.draw()

    async def run_task(self, client: httpx.AsyncClient) -> None:
        """The async driver's poller (a task; cancel it to stop)."""
        while True:
            await asyncio.sleep(self.poll_s)
            url = self.url()
            if url is not None:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    self.take(await client.get(url, timeout=5.0))
            self.draw()


@contextlib.contextmanager
def showing(wf: Workflow, client: httpx.Client) -> Iterator[None]:
    """Poll (a thread) and draw around a sync run when progress is wanted."""
    if not wanted(wf.progress):
        yield
        return
    tracker, stop = Tracker(wf), threading.Event()
    thread = threading.Thread(target=tracker.run_thread, args=(client, stop),
                              name=f"flowlift progress {wf.name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
        tracker.draw(final=True)


@contextlib.asynccontextmanager
async def tracking(wf: Workflow, client: httpx.AsyncClient) -> AsyncIterator[None]:
    """Poll and draw around an async run when progress is wanted."""
    if not wanted(wf.progress):
        yield
        return
    tracker = Tracker(wf)
    task = asyncio.create_task(tracker.run_task(client))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        tracker.draw(final=True)
