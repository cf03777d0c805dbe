"""No state crosses sessions or tenants on the proxy's shared upstream connections
(issue 37 item 1): a cookie an upstream sets on one session's answer never goes out on
another request (llm-d's ``llm-d-session`` cookie pinned every session of a proxy to one
pod), and client headers reach an upstream only through its ``pass_headers``
allowlist, which refuses secrets. Real sockets: the bug lived in aiohttp's cookie jar."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from flowlift.errors import ConfigError
from flowlift.proxy import create_app
from flowlift.proxy.config import UpstreamSpec, parse_config
from flowlift.proxy.dispatch.upstream.provider import client_headers
from flowlift.proxy.state import STATE
from tests.upstream_fake import FakeUpstream, Script, chat_json, upstream_only_proxy

MESSAGES = [{"role": "user", "content": "hi"}]


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def sets_cookie(name: str, value: str) -> Script:
    """Answers like llm-d's endpoint picker behind its gateway: a ``Set-Cookie``
    pinning the session to the pod that answered."""
    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.json_response(chat_json())
        resp.set_cookie(name, value, path="/", httponly=True)
        return resp
    return answer


async def _chat(client: Any, session: str, **headers: str) -> None:
    resp = await client.post("/v1/chat/completions", json={
        "model": "up", "messages": MESSAGES}, headers={"X-Flowlift-Session": session,
                                                       **headers})
    assert resp.status == 200, await resp.text()


async def _by_name_proxy(aiohttp_client: Any, aiohttp_server: Any,
                         fake: FakeUpstream) -> Any:
    """A proxy whose model ``up`` is ``fake``, reached by the host *name* ``localhost``
    (aiohttp's jar ignores cookies of bare IP addresses; a fleet has names)."""
    server = await aiohttp_server(fake.app())
    app = create_app({}, file_config=parse_config({
        "backends": {"r0": {"kind": "openai",
                            "base_url": f"http://localhost:{server.port}/v1"}},
        "models": {"up": {"backends": ["r0"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def test_a_cookie_set_for_one_session_never_reaches_another(aiohttp_client,
                                                                  aiohttp_server):
    fake = FakeUpstream([sets_cookie("llm-d-session", "pod-a")])
    client = await _by_name_proxy(aiohttp_client, aiohttp_server, fake)
    await _chat(client, "session-a")
    await _chat(client, "session-b")  # another session, maybe another tenant
    await _chat(client, "session-a")  # and not on the same session's next turn either
    assert len(fake.received) == 3
    assert [_lower(r.headers).get("cookie") for r in fake.received] == [None, None, None]


async def test_client_cookies_and_keys_never_pass(aiohttp_client, aiohttp_server):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    client = await upstream_only_proxy(aiohttp_client, aiohttp_server, fake)
    await _chat(client, "s", Cookie="llm-d-session=pod-b", **{"X-Api-Key": "sk-secret",
                                                              "X-Team": "red"})
    seen = {k.lower() for k in fake.received[0].headers}
    assert not seen & {"cookie", "x-api-key", "x-team"}


# -- the allowlist ------------------------------------------------------------------------
def test_pass_headers_forward_only_the_listed_client_headers():
    spec = UpstreamSpec(kind="openai", base_url="http://u.invalid/v1",
                        pass_headers=["X-Team", "x-llm-d-slo-ttft-ms"])
    assert spec.pass_headers == ["x-team", "x-llm-d-slo-ttft-ms"]  # (lower-cased)
    sent = client_headers(spec, {"x-team": "red", "x-other": "no", "cookie": "c=1"})
    assert sent == {"x-team": "red"}
    assert client_headers(UpstreamSpec(kind="openai", base_url="http://u.invalid/v1"),
                          {"x-team": "red"}) == {}


@pytest.mark.parametrize("name", ["Authorization", "cookie", "Proxy-Authorization",
                                  "x-api-key", "api-key", "X-Auth-Token", "x-client-secret",
                                  "x-password", "host", "content-length", "x-flowlift-key",
                                  "bad header"])
def test_pass_headers_refuse_secrets_and_hop_headers(name):
    with pytest.raises(ConfigError, match="pass_headers"):
        parse_config({"backends": {"u": {"kind": "openai", "base_url": "http://u.invalid/v1",
                                         "pass_headers": [name]}},
                      "models": {"m": {"backends": ["u"]}}})


async def test_pass_headers_reach_that_backend_only(aiohttp_client, aiohttp_server):
    a, b = FakeUpstream([FakeUpstream.json(chat_json())]), FakeUpstream(
        [FakeUpstream.json(chat_json())])
    urls = [str((await aiohttp_server(f.app())).make_url("/v1")) for f in (a, b)]
    app = create_app({}, file_config=parse_config({
        "backends": {"a": {"kind": "openai", "base_url": urls[0],
                           "pass_headers": ["x-team"]},
                     "b": {"kind": "openai", "base_url": urls[1]}},
        "models": {"ma": {"backends": ["a"]}, "mb": {"backends": ["b"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    for model in ("ma", "mb"):
        resp = await client.post("/v1/chat/completions", json={
            "model": model, "messages": MESSAGES}, headers={"X-Team": "red"})
        assert resp.status == 200
    assert _lower(a.received[0].headers).get("x-team") == "red"
    assert "x-team" not in _lower(b.received[0].headers)


async def test_a_non_ascii_passed_header_is_a_400_naming_it(aiohttp_client, aiohttp_server):
    fake = FakeUpstream([FakeUpstream.json(chat_json())])
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    app = create_app({}, file_config=parse_config({
        "backends": {"a": {"kind": "openai", "base_url": url, "pass_headers": ["x-team"]}},
        "models": {"m": {"backends": ["a"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    resp = await client.post("/v1/chat/completions", json={
        "model": "m", "messages": MESSAGES}, headers={"X-Team": "r\u00e9d"})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "header:x-team"
    assert fake.received == []
