"""The SDK's progress bar: counts, the line, terminal vs plain output, and a real run
(aiohttp test server on a FakeEngine) drawing it to stderr."""

from __future__ import annotations

import asyncio
import io

import pytest

from flowlift import step, workflow
from flowlift.sdk.progress import Counts, Progress, format_line, merge, wanted


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_merge_takes_done_and_failed_from_events_and_clamps_the_poll():
    c = merge(10, 3, 1, {"running": 2, "waiting_tool": 1, "queued": 2, "done": 1})
    assert (c.done, c.failed, c.running, c.queued, c.waiting) == (3, 1, 3, 2, 1)
    stale = merge(10, 9, 1, {"running": 4, "queued": 3})  # a poll older than the events
    assert (stale.running, stale.queued, stale.waiting) == (0, 0, 0)
    assert merge(4, 0, 0, None) == Counts(4)


def test_format_line():
    line = format_line(Counts(10, done=5, failed=1, running=2, queued=1), 3.25, "docs",
                       width=10)
    assert line == ("flowlift: docs [#####!>>. ] 5/10 done, 2 running, 1 queued, 1 failed, "
                    "1 waiting for inputs, 3.2 s")
    assert "[          ] 0/0 done" in format_line(Counts(0), 0.0, width=10)


def test_terminal_redraws_one_line_in_place():
    out = Stream(tty=True)
    p = Progress("x", out, interval_s=0.0)
    p.update(Counts(4, running=1))
    p.update(Counts(4, done=1))
    p.update(Counts(4, done=4), final=True)
    text = out.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("\n")
    assert "4/4 done" in text.rsplit("\r", 1)[1]


def test_plain_output_prints_lines_only_when_changed_and_due():
    out = Stream(tty=False)
    p = Progress("x", out, interval_s=0.0)
    p.update(Counts(4, running=1))
    p.update(Counts(4, running=1))  # unchanged: no new line
    p.update(Counts(4, done=1))
    slow = Progress("y", out, interval_s=3600)
    slow.update(Counts(4, done=1))
    slow.update(Counts(4, done=2))  # not due yet
    slow.update(Counts(4, done=4), final=True)  # the last line always comes
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert len(lines) == 4 and lines[-1].startswith("flowlift: y [") and "4/4 done" in lines[-1]


def test_a_broken_stream_never_breaks_the_run():
    out = Stream(tty=False)
    out.close()
    Progress("x", out, interval_s=0.0).update(Counts(1), final=True)


def test_wanted_follows_the_option_then_the_environment(monkeypatch):
    monkeypatch.delenv("FLOWLIFT_PROGRESS", raising=False)
    assert not wanted(None) and wanted(True)
    monkeypatch.setenv("FLOWLIFT_PROGRESS", "1")
    assert wanted(None) and not wanted(False)
    monkeypatch.setenv("FLOWLIFT_PROGRESS", "0")
    assert not wanted(None)


@step(max_tokens=20)
def item(x):
    return f"item {x} with a few more words"


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_run_draws_its_progress_to_stderr(client, engine, capsys, monkeypatch, mode):
    monkeypatch.setattr("flowlift.sdk.progress.PLAIN_INTERVAL_S", 0.05)
    engine.delay_s = 0.05  # ~0.4 s per step: several polls see it running
    base = str(client.make_url("")).rstrip("/")

    def run_sync():
        with workflow("batch", base_url=base, workflow_class="batch", progress=True) as wf:
            [item(i) for i in range(6)]
        return wf

    if mode == "sync":
        wf = await asyncio.to_thread(run_sync)
    else:
        async with workflow("batch", base_url=base, workflow_class="batch",
                            progress=True) as wf:
            [item(i) for i in range(6)]
    assert wf.status == "succeeded"
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("flowlift: batch [") and "6/6 done" in err[-1]
    assert any("running" in ln and "/6 done" in ln and "6/6" not in ln for ln in err[:-1]), err


async def test_no_progress_unless_asked(client, capsys, monkeypatch):
    monkeypatch.delenv("FLOWLIFT_PROGRESS", raising=False)
    base = str(client.make_url("")).rstrip("/")
    async with workflow("quiet", base_url=base):
        item(1)
    assert "flowlift:" not in capsys.readouterr().err


def test_terminal_line_fits_the_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    out = Stream(tty=True)
    Progress("a-long-workflow-name", out, interval_s=0.0).update(Counts(10, done=3))
    assert len(out.getvalue()) == 1 + 39
