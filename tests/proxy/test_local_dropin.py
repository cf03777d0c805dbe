"""A local drop-in request is decided once at its route and never enters the upstream
forwarder (issue 33, item 4: proxy/dispatch/local.py)."""

from __future__ import annotations

from typing import Any

from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.dispatch.local import choose_local
from flowlift.proxy.openai import routes
from flowlift.testing import FakeEngine


async def test_a_local_drop_in_request_never_enters_the_forwarder(client, monkeypatch):
    async def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the upstream forwarder was entered for a local request")

    monkeypatch.setattr(routes, "forward", refuse)
    resp = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": "a b c"}]})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"]


def test_choose_local_takes_only_routes_with_nothing_but_embedded_backends():
    backends = Backends({"m": FakeEngine(["m"])})
    local = choose_local(backends, backends.route("m"), None)
    assert local is not None and local.model == "m"
    backends.upstreams["up"] = object()  # type: ignore[assignment]
    mixed = backends.route("m").__class__("m", ("embedded:m", "up"))
    assert choose_local(backends, mixed, None) is None
