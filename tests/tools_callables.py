"""Python callables the proxy-tool tests name in ``[tools.*] callables`` (and the
scripted responder of the kill -9 test's fake engine)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Annotated

from pydantic import Field

from flowlift.local_engine.base import GenerationRequest
from flowlift.testing import tool_calls_text

STARTED: list[tuple[str, float]] = []


async def lookup(city: Annotated[str, Field(description="a city name")], k: int = 1) -> str:
    """Look a city up in the atlas."""
    STARTED.append((city, time.monotonic()))
    return f"{city}: {k} hit(s)"


def slow_sync(seconds: float) -> str:
    """Block for a while (a plain function: runs in a thread)."""
    time.sleep(seconds)
    return "done"


def counted(note: str) -> str:
    """Append ``note`` to the file in COUNT_FILE (a side effect the kill -9 test counts)."""
    with open(os.environ["COUNT_FILE"], "a", encoding="utf-8") as f:
        f.write(note + "\n")
    return f"noted {note}"


def kill9_responder(request: GenerationRequest) -> str:
    """Turn 1 calls ``counted``; turn 2 (the result is in the conversation) answers
    with a long text, so the fake engine takes seconds to stream it (the proxy is
    killed meanwhile)."""
    if any("noted" in m.content for m in request.messages):
        return "done " * 150
    return tool_calls_text(("counted", {"note": "once"}))


def huge(n: int) -> str:
    """Return ``n`` bytes of text (a 10 MB result)."""
    return "y" * n


class Meeting:
    """Two calls that each wait for the other: both finish only when they run at the
    same time (one an app @tool, one a proxy callable, in one turn)."""

    def __init__(self) -> None:
        self.arrived = 0
        self.both: asyncio.Event | None = None

    async def meet(self) -> str:
        self.both = self.both or asyncio.Event()
        self.arrived += 1
        if self.arrived == 2:
            self.both.set()
        await asyncio.wait_for(self.both.wait(), timeout=5)
        return "met"


MEETING = Meeting()


async def meet() -> str:
    """Wait for the app's tool of the same turn."""
    return await MEETING.meet()
