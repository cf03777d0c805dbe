"""Shared fixtures: the proxy on a FakeEngine (no model), and an SSE reader for tests."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(["fake-model", "other-model"])


@pytest.fixture
def make_app(engine: FakeEngine):
    def make(config: ProxyConfig | None = None) -> web.Application:
        return create_app({"fake-model": engine, "other-model": engine}, config)
    return make


@pytest.fixture
async def client(aiohttp_client, make_app):
    app = make_app()
    c = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return c


def parse_sse(text: str) -> list[tuple[str, Any]]:
    """``[(event, data)]`` of an SSE body (data JSON-decoded when it is JSON)."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            raw = "\n".join(data)
            try:
                events.append((name, json.loads(raw)))
            except json.JSONDecodeError:
                events.append((name, raw))
    return events
