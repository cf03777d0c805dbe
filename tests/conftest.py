"""Shared fixtures: the proxy on a FakeEngine (no model)."""

from __future__ import annotations

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
