"""OpenAI's published API description, for the conformance tests, the fuzzer and the
real-client tests.

``tests/data/openai-openapi.subset.json`` is the part of ``openai-openapi.yaml``
(repository openai/openai-openapi, commit f85dbe223d40e1a31cba812ab2d755c7e98a92a3; MIT
licence in ``tests/data/openai-openapi.LICENSE``) that flowlift's drop-in endpoints need:
the operations createChatCompletion, createCompletion, createEmbedding, listModels and
the Responses API's createResponse, getResponse, deleteResponse and listInputItems,
the response schemas the tests name, and every component they reference, unchanged but
for the operations' examples (``x-oaiMeta``), which are left out. CI has no copy of the
whole file; regenerate the subset with::

    .venv/bin/python -m tests.openapi_spec ../shared/specs/openai-openapi.yaml

The description is OpenAPI 3.1 but still says ``nullable: true`` in places (3.0 style)
and puts ``discriminator`` on ``oneOf``; :func:`validate` reads it as plain JSON Schema
2020-12 after rewriting those two (``nullable`` -> ``anyOf [..., null]``, a
discriminated ``oneOf`` -> ``anyOf``: its branches differ in the discriminator anyway).

Also here: :class:`LiveServers`, aiohttp apps on real ports in a background loop (for
synchronous clients: ``openai.OpenAI``, LangChain, schemathesis), and
:func:`spec_upstream`, a fake OpenAI upstream whose every answer is spec-valid.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import FileConfig, parse_config
from flowlift.proxy.state import STATE
from flowlift.testing import FakeEngine
from tests.upstream_fake import FakeUpstream, sse_bytes

SUBSET = Path(__file__).parent / "data" / "openai-openapi.subset.json"
OPERATIONS = {("/chat/completions", "post"), ("/completions", "post"),
              ("/embeddings", "post"), ("/models", "get"), ("/responses", "post"),
              ("/responses/{response_id}", "get"), ("/responses/{response_id}", "delete"),
              ("/responses/{response_id}/input_items", "get")}
RESPONSE_SCHEMAS = ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
                    "CreateCompletionResponse", "CreateEmbeddingResponse",
                    "ListModelsResponse", "ErrorResponse", "Response",
                    "ResponseStreamEvent", "ResponseItemList", "CreateResponse")
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


# -- the vendored subset ----------------------------------------------------------------
def _refs(node: Any, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            out.add(node["$ref"])
        for key, value in node.items():
            if key != "x-oaiMeta":
                _refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out)
    return out


def make_subset(full: dict[str, Any]) -> dict[str, Any]:
    """The subset of the whole description ``full`` described in the module docstring."""
    paths: dict[str, Any] = {}
    for path, method in sorted(OPERATIONS):
        op = {k: v for k, v in full["paths"][path][method].items() if k != "x-oaiMeta"}
        paths.setdefault(path, {})[method] = op
    todo = _refs(paths, {f"#/components/schemas/{n}" for n in RESPONSE_SCHEMAS})
    components: dict[str, dict[str, Any]] = {}
    while todo:
        _, _, kind, name = todo.pop().split("/")
        if name not in components.setdefault(kind, {}):
            components[kind][name] = full["components"][kind][name]
            todo |= _refs(components[kind][name], set())
    components["securitySchemes"] = full["components"]["securitySchemes"]
    return {"openapi": full["openapi"], "info": full["info"], "servers": full["servers"],
            "security": full["security"], "paths": paths,
            "components": {k: dict(sorted(v.items())) for k, v in sorted(components.items())}}


@functools.cache
def openapi() -> dict[str, Any]:
    """The vendored subset as an OpenAPI document (loaded once; do not mutate it)."""
    return json.loads(SUBSET.read_text())


def _plain(node: Any) -> Any:
    """``node`` (a schema) as JSON Schema 2020-12: without ``nullable``/``discriminator``."""
    if isinstance(node, list):
        return [_plain(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: ({name: _plain(s) for name, s in v.items()} if k in _SCHEMA_MAPS
               and isinstance(v, dict) else _plain(v))
           for k, v in node.items() if k not in ("nullable", "discriminator")}
    if "discriminator" in node and "oneOf" in out:
        out["anyOf"] = out.pop("oneOf")
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _components() -> dict[str, Any]:
    return _plain(openapi()["components"])


@functools.cache
def validator(schema_name: str) -> Draft202012Validator:
    """A validator of ``#/components/schemas/<schema_name>`` (refs resolve in the spec)."""
    if schema_name not in openapi()["components"]["schemas"]:
        raise KeyError(f"{schema_name} is not in the vendored subset; add it to "
                       "RESPONSE_SCHEMAS and regenerate")
    return Draft202012Validator({"$ref": f"#/components/schemas/{schema_name}",
                                 "components": _components()})


def _describe(err: ValidationError) -> str:
    deepest = best_match(err.context) if err.context else err
    return f"{deepest.json_path}: {deepest.message[:300]}"


def validate(instance: Any, schema_name: str) -> None:
    """Assert that ``instance`` is a valid ``schema_name`` of the spec.

    Raises:
        AssertionError: listing each violation at its JSON path.
    """
    errors = sorted(validator(schema_name).iter_errors(instance), key=lambda e: e.json_path)
    if errors:
        raise AssertionError(f"not a valid {schema_name}:\n  "
                             + "\n  ".join(_describe(e) for e in errors)
                             + f"\ninstance: {json.dumps(instance)[:2000]}")


def validate_event(event: dict[str, Any]) -> None:
    """Assert that ``event`` is a valid Responses stream event: against the one branch of
    ``ResponseStreamEvent`` its ``type`` names (the union has no discriminator, so a
    failure would otherwise be reported against whichever branch matched best)."""
    union = openapi()["components"]["schemas"]["ResponseStreamEvent"]
    names = {}
    for branch in union.get("anyOf") or union.get("oneOf") or ():
        name = branch["$ref"].rsplit("/", 1)[1]
        kind = openapi()["components"]["schemas"][name]["properties"]["type"]
        names[(kind.get("enum") or [kind.get("const")])[0]] = name
    assert event.get("type") in names, f"no stream event of type {event.get('type')!r}"
    validate(event, names[event["type"]])


# -- a spec-valid upstream -------------------------------------------------------------
TOOL_CALL = {"id": "call_up0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _logprob(token: str) -> dict[str, Any]:
    item = {"token": token, "logprob": -0.5, "bytes": list(token.encode())}
    return {**item, "top_logprobs": [item]}


def upstream_chat(data: dict[str, Any]) -> dict[str, Any]:
    """A ``CreateChatCompletionResponse`` for ``data``: tool calls when it sends tools,
    ``n`` choices, logprobs when asked, else ``"upstream says hi"``."""
    calls = [TOOL_CALL] if data.get("tools") else None
    lp = {"content": [_logprob("upstream")], "refusal": None} if data.get("logprobs") else None
    choices = [{"index": i, "logprobs": lp, "finish_reason": "tool_calls" if calls else "stop",
                "message": {"role": "assistant", "content": None if calls else
                            "upstream says hi", "refusal": None,
                            **({"tool_calls": calls} if calls else {})}}
               for i in range(data.get("n") or 1)]
    return {"id": "chatcmpl-up", "object": "chat.completion", "created": 1700000000,
            "model": data["model"], "choices": choices, "system_fingerprint": "fp_up",
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}


def upstream_chunks(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``CreateChatCompletionStreamResponse`` chunks of :func:`upstream_chat`'s answer."""
    whole = upstream_chat(data)
    head = {k: whole[k] for k in ("id", "created", "model")} | {
        "object": "chat.completion.chunk"}
    out = []
    for choice in whole["choices"]:
        i, msg = choice["index"], choice["message"]
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if msg.get("tool_calls"):
            deltas += [{"tool_calls": [{"index": j, **c}]} for j, c in
                       enumerate(msg["tool_calls"])]
        else:
            deltas += [{"content": w} for w in ("upstream", " says", " hi")]
        out += [{**head, "choices": [{"index": i, "delta": d, "logprobs": None,
                                      "finish_reason": None}]} for d in deltas]
        out.append({**head, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                         "finish_reason": choice["finish_reason"]}]})
    if (data.get("stream_options") or {}).get("include_usage"):
        out.append({**head, "choices": [], "usage": whole["usage"]})
    return out


def upstream_completion(data: dict[str, Any]) -> dict[str, Any]:
    return {"id": "cmpl-up", "object": "text_completion", "created": 1700000000,
            "model": data["model"],
            "choices": [{"index": 0, "text": " upstream text", "logprobs": None,
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}}


def upstream_embeddings(data: dict[str, Any]) -> dict[str, Any]:
    inputs = data.get("input")
    n = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(
        inputs[0], int) else 1
    return {"object": "list", "model": data["model"],
            "data": [{"object": "embedding", "index": i, "embedding": [0.1, -0.2, 0.3]}
                     for i in range(n)],
            "usage": {"prompt_tokens": 2, "total_tokens": 2}}


UPSTREAM_ERRORS = {400: "invalid_request_error", 401: "authentication_error",
                   404: "not_found_error", 422: "invalid_request_error",
                   429: "rate_limit_error", 500: "server_error"}


def _error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "param": None, "code": None,
                      "type": UPSTREAM_ERRORS.get(status, "server_error")}}


async def spec_upstream(request: web.Request) -> web.StreamResponse:
    """A :class:`FakeUpstream` script: a spec-valid answer to any request it can read (a
    400 error to others, like a real upstream). A request whose ``user`` is
    ``"status-<code>"`` gets an OpenAI error body with that status."""
    try:
        data = json.loads(await request.read())
        user = str(data.get("user") or "")
        status = int(user.removeprefix("status-")) if user.startswith("status-") else 200
        n = data.get("n") or 1
        assert isinstance(data["model"], str) and isinstance(n, int) and 0 < n <= 128
        assert isinstance(data.get("stream", False), bool | None)
    except (ValueError, AttributeError, KeyError, AssertionError):
        return await FakeUpstream.json(_error(400, "unreadable request"), status=400)(request)
    if status != 200:
        return await FakeUpstream.json(_error(status, f"upstream refused with {status}"),
                                       status=status)(request)
    if request.path.endswith("/chat/completions"):
        if data.get("stream"):
            return await FakeUpstream.stream(sse_bytes(*upstream_chunks(data)))(request)
        return await FakeUpstream.json(upstream_chat(data))(request)
    if request.path.endswith("/completions"):
        whole = upstream_completion(data)
        if data.get("stream"):
            return await FakeUpstream.stream(sse_bytes(
                {**whole, "usage": None}, {**whole, "choices": []}))(request)
        return await FakeUpstream.json(whole)(request)
    if request.path.endswith("/embeddings"):
        return await FakeUpstream.json(upstream_embeddings(data))(request)
    return await FakeUpstream.json(_error(404, "no such path"), status=404)(request)


def upstream_models(base_url: str, *models: str) -> FileConfig:
    """A config in which each of ``models`` is served by the upstream at ``base_url``
    (one attempt, no cool-down: each upstream error reaches the client as it is)."""
    return parse_config({
        "backends": {"up": {"kind": "openai", "base_url": base_url,
                            "failures_to_cool": 1_000_000}},
        "models": {m: {"backends": ["up"], "max_attempts": 1} for m in models}})


def proxy_app(upstream_url: str | None = None, config: ProxyConfig | None = None,
              engine: FakeEngine | None = None) -> web.Application:
    """The proxy: ``fake-model`` on a FakeEngine (the embedded path) and, with
    ``upstream_url``, ``up-model`` served by that upstream."""
    file_config = None if upstream_url is None else upstream_models(upstream_url, "up-model")
    return create_app({"fake-model": engine or FakeEngine(["fake-model"])}, config,
                      file_config=file_config)


# -- apps on real ports in a background loop -------------------------------------------
class LiveServers:
    """An event loop in a daemon thread serving aiohttp apps on real ports, so that
    synchronous clients can talk to them from the test's thread.

    Use as a context manager; :meth:`serve` returns each app's base URL.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runners: list[web.AppRunner] = []

    def __enter__(self) -> LiveServers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for runner in reversed(self._runners):
                await runner.cleanup()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:  # handlers of requests a client gave up on
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        """Run ``coro`` on the servers' loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def serve(self, make_app: Callable[[], web.Application]) -> str:
        """Build an app with ``make_app`` (on the loop), serve it on a free port and wait
        until a proxy's engines are ready. Returns ``http://127.0.0.1:<port>``."""
        async def start() -> str:
            app = make_app()
            runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1)
            await runner.setup()
            self._runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            if STATE in app:
                await asyncio.wait_for(app[STATE].ready.wait(), 10)
            host, port = runner.addresses[0][:2]
            return f"http://{host}:{port}"
        return self.call(start())  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Live:
    """A running :func:`proxy_app`: its base URL (without ``/v1``), its fake upstream
    (requests in ``upstream.received``) and its engine (``engine.requests``)."""

    url: str
    upstream: FakeUpstream
    engine: FakeEngine


def live_proxy() -> Iterator[Live]:
    """For a module-scoped fixture: the proxy of :func:`proxy_app` on a real port, its
    ``up-model`` served by a :func:`spec_upstream`."""
    upstream, engine = FakeUpstream([spec_upstream]), FakeEngine(["fake-model"])
    with LiveServers() as servers:
        up_url = servers.serve(upstream.app)
        yield Live(servers.serve(lambda: proxy_app(f"{up_url}/v1", engine=engine)),
                   upstream, engine)


def _main(source: str) -> None:
    import yaml

    full = yaml.load(Path(source).read_text(), Loader=getattr(yaml, "CSafeLoader",
                                                               yaml.SafeLoader))
    SUBSET.parent.mkdir(exist_ok=True)
    SUBSET.write_text(json.dumps(make_subset(full), indent=1, default=str,
                                 ensure_ascii=False) + "\n")
    print(f"wrote {SUBSET} ({SUBSET.stat().st_size} bytes)")


if __name__ == "__main__":
    _main(sys.argv[1])
