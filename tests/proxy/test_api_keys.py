"""The SDK and the CLI against a proxy that wants API keys (``ProxyConfig(api_keys=...)``,
``[server] api_keys_env`` in a config file): the key goes as ``Authorization: Bearer`` on
every request (graph, event stream, tool results, progress polls, cancel), a missing or
wrong one is an AuthenticationError naming FLOWLIFT_API_KEY, and the key shows up in no
log, span or error."""

from __future__ import annotations

import asyncio
import json
import logging
import textwrap
import time

import httpx
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from flowlift import step, tool, workflow
from flowlift.cli import main
from flowlift.errors import AuthenticationError, WorkflowFailed
from flowlift.proxy import ProxyConfig
from flowlift.proxy.state import STATE
from flowlift.testing import capture_spans

KEY = "sk-flowlift-canary-5e1b"
WRONG = "sk-wrong-canary-0d4c"


@step(max_tokens=8)
def think(x):
    return f"Think about {x}"


@tool
def lookup(text):
    time.sleep(0.2)  # long enough for a progress poll
    return {"found": len(text)}


@step(max_tokens=8)
def answer(x, found):
    return f"Answer {x} with {found}"


def pipeline(x="doc"):
    thought = think(x)
    return answer(thought, lookup(thought))


@pytest.fixture
async def keyed(aiohttp_client, make_app):
    """(base_url, seen): a proxy wanting KEY on a real port; ``seen`` lists
    ``(method, path, Authorization)`` of every request it got, refused ones too."""
    seen: list[tuple[str, str, str]] = []

    @web.middleware
    async def record(request, handler):
        seen.append((request.method, request.path, request.headers.get("Authorization", "")))
        return await handler(request)

    app = make_app(ProxyConfig(api_keys=frozenset({KEY})))
    app.middlewares.insert(0, record)  # outermost: sees what require_key refuses
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return str(client.make_url("")).rstrip("/"), seen


def _no_key_in(*texts: str) -> None:
    for text in texts:
        assert KEY not in text and WRONG not in text


async def test_sync_workflow_with_tools_progress_and_cancel_sends_the_key(keyed, caplog,
                                                                         monkeypatch):
    base, seen = keyed
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr("flowlift.sdk.progress.PLAIN_INTERVAL_S", 0.05)

    def run():
        with workflow("keyed", base_url=base, api_key=KEY, progress=True) as wf:
            out = pipeline()
        assert wf.cancel() is False  # finished: nothing sent
        return wf, out

    with capture_logs() as logs, capture_spans() as spans:
        wf, out = await asyncio.to_thread(run)
    assert wf.status == "succeeded" and out.value.startswith("echo: Answer")
    paths = {(m, p.rsplit("/", 1)[-1]) for m, p, _ in seen}
    assert ("POST", "workflows") in paths and ("POST", "result") in paths
    assert ("GET", "progress") in paths  # the poller (sdk/progress.py) on the same client
    assert {auth for *_, auth in seen} == {f"Bearer {KEY}"}
    _no_key_in(repr(logs), caplog.text, repr(vars(wf).get("trace")),
               repr([(s.name, dict(s.attributes or {}), [e.attributes for e in s.events],
                      s.status.description) for s in spans.spans]))
    assert spans.named("invoke_workflow keyed") and spans.named("execute_tool lookup")


async def test_async_workflow_takes_the_key_from_the_environment(keyed, monkeypatch):
    base, seen = keyed
    monkeypatch.setenv("FLOWLIFT_API_KEY", KEY)
    async with workflow("keyed-async", base_url=base) as wf:
        out = pipeline()
    assert wf.status == "succeeded" and out.value.startswith("echo: Answer")
    assert {auth for *_, auth in seen} == {f"Bearer {KEY}"}


async def test_cancel_sends_the_key(keyed):
    base, seen = keyed
    box: dict[str, object] = {}

    @tool
    def stop_here(text):
        box["cancelled"] = box["wf"].cancel()  # type: ignore[attr-defined]
        return "stopped"

    def run():
        with pytest.raises(WorkflowFailed), workflow("cancelled", base_url=base,
                                                 api_key=KEY) as wf:
            box["wf"] = wf
            answer(think("x"), stop_here("y"))
        return wf

    wf = await asyncio.to_thread(run)
    assert box["cancelled"] is True and wf.status == "cancelled"
    assert [a for m, _, a in seen if m == "DELETE"] == [f"Bearer {KEY}"]


@pytest.mark.parametrize("key", [None, WRONG])
async def test_no_or_a_wrong_key_is_an_authentication_error(keyed, monkeypatch, key):
    base, _ = keyed
    monkeypatch.delenv("FLOWLIFT_API_KEY", raising=False)
    with pytest.raises(AuthenticationError) as info:
        async with workflow("refused", base_url=base, api_key=key):
            pipeline()
    message = str(info.value)
    assert "FLOWLIFT_API_KEY" in message and "api_key=" in message
    assert info.value.status == 401
    _no_key_in(message)


async def test_an_eager_step_outside_a_workflow_sends_the_environments_key(keyed,
                                                                          monkeypatch):
    base, seen = keyed
    monkeypatch.setenv("FLOWLIFT_BASE_URL", base)
    monkeypatch.setenv("FLOWLIFT_API_KEY", KEY)
    value = await asyncio.to_thread(think, "alone")
    assert value.startswith("echo: Think about alone")
    assert [a for m, p, a in seen if m == "POST"] == [f"Bearer {KEY}"]
    monkeypatch.delenv("FLOWLIFT_API_KEY")
    with pytest.raises(AuthenticationError):
        await asyncio.to_thread(think, "alone")


# -- the CLI --------------------------------------------------------------------------
def _cli(*argv: str) -> int:
    return main(list(argv))


async def test_trace_with_and_without_the_key(keyed, capsys, monkeypatch):
    base, _ = keyed
    monkeypatch.delenv("FLOWLIFT_API_KEY", raising=False)
    async with workflow("traced", base_url=base, api_key=KEY) as wf:
        pipeline()
    assert await asyncio.to_thread(_cli, "trace", wf.run_id, "--base-url", base,
                                   "--api-key", KEY) == 0
    assert f"\nrun {wf.run_id} 'traced': succeeded" in "\n" + capsys.readouterr().out
    assert await asyncio.to_thread(_cli, "trace", wf.run_id, "--base-url", base) == 1
    err = capsys.readouterr().err
    assert "invalid API key" in err and "--api-key" in err and "FLOWLIFT_API_KEY" in err
    monkeypatch.setenv("FLOWLIFT_API_KEY", KEY)
    assert await asyncio.to_thread(_cli, "trace", wf.run_id, "--base-url", base) == 0


async def test_models_and_compile_with_and_without_the_key(keyed, capsys, tmp_path,
                                                           monkeypatch):
    base, seen = keyed
    monkeypatch.delenv("FLOWLIFT_API_KEY", raising=False)
    assert await asyncio.to_thread(_cli, "models", "--base-url", base, "--api-key", KEY) == 0
    out = capsys.readouterr().out
    assert "serves fake-model" in out and "answered 401" not in out
    assert await asyncio.to_thread(_cli, "models", "--base-url", base) == 0
    out = capsys.readouterr().out
    assert "serves fake-model" not in out and "answered 401 (pass --api-key" in out

    with workflow("compiled", submit=False) as wf:
        pipeline()
    graph = tmp_path / "graph.json"
    graph.write_text(json.dumps(wf.graph().to_wire()))
    assert await asyncio.to_thread(_cli, "compile", str(graph), "--json", "--base-url", base,
                                   "--api-key", KEY) == 0
    assert "critical_path" in json.loads(capsys.readouterr().out)
    assert await asyncio.to_thread(_cli, "compile", str(graph), "--base-url", base) == 1
    assert "--api-key" in capsys.readouterr().err
    compiles = [a for m, p, a in seen if p == "/v1/workflows:compile"]
    assert compiles == [f"Bearer {KEY}", ""]
    assert "--api-key KEY" in await asyncio.to_thread(_help, "models")


def _help(command: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    return out.getvalue()


async def test_run_hands_the_key_to_the_script(keyed, tmp_path, monkeypatch):
    base, seen = keyed
    monkeypatch.delenv("FLOWLIFT_API_KEY", raising=False)
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        from flowlift import step, workflow

        @step(max_tokens=4)
        def hello(x):
            return f"hello {{x}}"

        assert os.environ["FLOWLIFT_BASE_URL"] == {base!r}
        with workflow("from-run") as wf:
            out = hello("there")
        sys.exit(0 if out.value.startswith("echo: hello") else 3)
    """))
    rc = await asyncio.to_thread(_cli, "run", "--base-url", base, "--api-key", KEY,
                                 "--no-progress", str(script))
    assert rc == 0, "the script's workflow failed"
    assert [a for m, p, a in seen if p == "/v1/workflows" and m == "POST"] == [f"Bearer {KEY}"]
    listed = [a for m, p, a in seen if p == "/v1/workflows" and m == "GET"]  # runs it made
    assert listed == [f"Bearer {KEY}"]
    rc = await asyncio.to_thread(_cli, "run", "--base-url", base, "--no-progress",
                                 str(script))
    assert rc == 1  # AuthenticationError: an uncaught exception in the script


def test_a_401_without_json_from_a_gateway_is_an_authentication_error():
    seen: list[str] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("Authorization", ""))
        return httpx.Response(401, text="<html>401 Authorization Required</html>")

    with pytest.raises(AuthenticationError, match="FLOWLIFT_API_KEY") as info, \
            workflow("gated", base_url="http://gateway.invalid", api_key=WRONG,
                     transport=httpx.MockTransport(gateway)):
        think("x")
    assert seen == [f"Bearer {WRONG}"]
    _no_key_in(str(info.value))


def test_serve_with_a_keys_config_file_and_the_cli_end_to_end(tmp_path, monkeypatch):
    """The whole path a user takes: ``[server] api_keys_env`` in a TOML file, the keys in
    that variable, ``flowlift serve --config``; then ``flowlift run`` of a script and
    ``flowlift trace`` with ``FLOWLIFT_API_KEY`` set, and a 401 without it."""
    import subprocess
    import sys

    from flowlift.testing import running_proxy

    config = tmp_path / "keys.toml"
    config.write_text('[server]\napi_keys_env = "FLOWLIFT_API_KEYS"\n'
                      '[backends.local]\nkind = "embedded"\n')
    monkeypatch.setenv("FLOWLIFT_API_KEYS", f"other-key,{KEY}")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        from flowlift import step, workflow

        @step(max_tokens=4)
        def hello(x):
            return f"hello {x}"

        with workflow("served") as wf:
            out = hello("there")
        print(wf.run_id, out.value)
    """))
    with running_proxy("--engine", "fake", "--state-db", ":memory:", "--config", str(config),
                       log_path=tmp_path / "proxy.log", ready_timeout_s=60) as (base, _):
        monkeypatch.delenv("FLOWLIFT_API_KEY", raising=False)
        cli = [sys.executable, "-m", "flowlift.cli"]
        refused = subprocess.run([*cli, "run", "--base-url", base, "--no-progress",
                                  str(script)], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "AuthenticationError" in refused.stderr
        assert "FLOWLIFT_API_KEY" in refused.stderr
        monkeypatch.setenv("FLOWLIFT_API_KEY", KEY)
        ran = subprocess.run([*cli, "run", "--base-url", base, "--no-progress", str(script)],
                             capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        run_id, value = ran.stdout.split()[0], ran.stdout.split(maxsplit=1)[1]
        assert run_id.startswith("wf-") and value.startswith("echo: hello")
        traced = subprocess.run([*cli, "trace", run_id, "--base-url", base],
                                capture_output=True, text=True, timeout=60)
        assert traced.returncode == 0 and f"run {run_id} 'served'" in traced.stdout
    _no_key_in((tmp_path / "proxy.log").read_text(), refused.stderr, ran.stderr,
               traced.stderr)
