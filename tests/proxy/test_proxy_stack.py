"""The proxy's one middleware (:func:`flowlift.proxy.middleware.proxy_stack`): tracing,
the OpenAI error shape, API keys and the readiness gate as plain calls in one coroutine,
in that order, as the four middlewares were."""

from __future__ import annotations

from aiohttp import web

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.lifecycle import DRAIN
from flowlift.proxy.middleware import proxy_stack
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def _client(aiohttp_client, config=None, routes=()):
    app = create_app({"fake-model": FakeEngine(["fake-model"])}, config)
    for path, handler in routes:
        app.router.add_post(path, handler)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return app, client


def test_the_app_has_one_middleware_of_its_own():
    app = create_app({"fake-model": FakeEngine(["fake-model"])})
    (only,) = app.middlewares
    assert only.__qualname__ == proxy_stack.__qualname__ + ".<locals>.stack"


async def test_a_failure_is_answered_in_the_openai_shape_and_leaves_the_drain_count(
        aiohttp_client):
    async def boom(request: web.Request) -> web.StreamResponse:
        assert request.app[DRAIN].in_flight == 1  # counted while it runs
        raise RuntimeError("boom")

    async def moved(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/elsewhere")

    app, client = await _client(aiohttp_client, routes=[("/v1/boom", boom),
                                                         ("/v1/moved", moved)])
    resp = await client.post("/v1/boom")
    assert resp.status == 500
    assert (await resp.json())["error"]["code"] == "internal_error"
    resp = await client.post("/v1/moved", allow_redirects=False)
    assert resp.status == 302  # a redirect is no failure: it goes out as it is
    assert app[DRAIN].in_flight == 0


async def test_a_request_the_key_check_refuses_is_traced_and_counted(aiohttp_client):
    app, client = await _client(aiohttp_client, ProxyConfig(api_keys=frozenset({"sk-x"})))
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 401
    assert "x-flowlift-overhead-ms" in resp.headers  # the span began before the check
    resp = await client.post("/v1/chat/completions", json=CHAT,
                             headers={"Authorization": "Bearer sk-x"})
    assert resp.status == 200
    text = await (await client.get("/metrics")).text()
    assert 'flowlift_openai_requests_total{operation="chat",outcome="error"} 1.0' in text
    assert 'flowlift_openai_requests_total{operation="chat",outcome="complete"} 1.0' in text
    assert app[DRAIN].in_flight == 0
