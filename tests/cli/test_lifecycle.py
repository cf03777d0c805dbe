"""The proxy's life: /healthz and /readyz, the SIGTERM drain (in-flight work finishes,
new work is refused, runs past the grace period are checkpointed and resume after a
restart), and config errors at start (one message, exit 2, no traceback)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from flowlift import cli, step, tool, workflow
from flowlift.cli import run as cli_run
from flowlift.costs import CostTracker
from flowlift.errors import EngineError
from flowlift.graph import Graph
from flowlift.proxy.dispatch.backends import Backends
from flowlift.proxy.lifecycle import DRAIN
from flowlift.proxy.state import STATE
from flowlift.proxy.store.sqlite import RunStore
from flowlift.proxy.workflows.planning import plan
from flowlift.proxy.workflows.registry import RunRegistry
from flowlift.testing import FakeEngine, free_port, running_proxy

# -- readiness and the drain gate, in process ------------------------------------------


async def test_healthz_alive_and_readyz_names_why_not_ready(client):
    assert (await client.get("/healthz")).status == 200
    r = await client.get("/readyz")
    assert r.status == 200 and (await r.json())["reason"] is None
    client.app[STATE].runs.store.close()
    r = await client.get("/readyz")
    body = await r.json()
    assert r.status == 503 and not body["ready"]
    assert "run store" in body["reason"] and body["error"] is None
    assert (await client.get("/healthz")).status == 200  # alive, just not ready


async def test_readyz_503_while_the_engine_loads(aiohttp_client, make_app):
    app = make_app()
    c = await aiohttp_client(app)
    await app[STATE].ready.wait()
    app[STATE].ready.clear()
    r = await c.get("/readyz")
    assert r.status == 503 and (await r.json())["reason"] == "the engine is still loading"


async def test_draining_refuses_new_work_and_serves_the_rest(client):
    client.app[DRAIN].draining_since = time.monotonic()
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/v1/chat/completions", chat), ("/v1/workflows", {"nodes": []}),
                       ("/v1/completions", {"model": "fake-model", "prompt": "x"})):
        r = await client.post(path, json=body)
        assert r.status == 503, path
        assert int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["code"] == "shutting_down"
    r = await client.get("/v1/workflows/wf-gone/events")  # no run here to follow
    assert r.status == 503
    r = await client.get("/readyz")
    assert r.status == 503 and (await r.json())["reason"].startswith("draining")
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/v1/models")).status == 200
    # a tool result for a run under way is not new work: it passes the gate (404 here:
    # no such run) instead of getting 503
    r = await client.post("/v1/workflows/wf-x/steps/s/result", json={"value": 1})
    assert r.status == 404 and (await r.json())["error"]["code"] == "run_not_found"


async def test_in_flight_count_covers_requests_not_probes(client):
    drain = client.app[DRAIN]
    await client.get("/healthz")
    assert drain.in_flight == 0
    r = await client.post("/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "stream": True})
    assert drain.in_flight == 1  # the stream is open
    await r.read()
    assert drain.in_flight == 0


class _ClosingEngine(FakeEngine):
    """An engine that answers a shutdown with its own error (as a closed upstream
    connection does) instead of the cancellation."""

    async def generate(self, request):  # type: ignore[no-untyped-def, override]
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise EngineError("engine closed") from None
        yield  # pragma: no cover


async def test_a_suspended_run_records_no_failure_caused_by_the_shutdown():
    store = RunStore(":memory:")
    graph = Graph.model_validate({"nodes": [{"kind": "llm", "id": "a", "messages": [
        {"role": "user", "content": [{"text": "hi"}]}]}]})
    backends = Backends({"m": _ClosingEngine(["m"])})
    run = await RunRegistry(store).start(graph, backends, CostTracker(), plan(graph, backends,
                                                                        CostTracker()))
    await asyncio.sleep(0.05)
    run.suspend()
    await asyncio.wait([run.task])
    await asyncio.sleep(0.05)
    stored = store.load(run.run_id)
    assert stored.status == "running" and not stored.failures()  # resumes, "a" runs again


async def test_drain_does_not_wait_for_runs_parked_until_their_client_returns(
        aiohttp_client, make_app, tmp_path):
    from flowlift.proxy import ProxyConfig
    from flowlift.proxy.lifecycle import drain

    db = tmp_path / "state.sqlite"
    graph = Graph.model_validate({"nodes": [{"kind": "llm", "id": "a", "model": "fake-model",
                                             "messages": [{"role": "user",
                                                           "content": [{"text": "hi"}]}]}]})
    RunStore(db).create("wf-parked", graph.to_wire())  # left unfinished by a crash
    app = make_app(ProxyConfig(state_path=db))
    await aiohttp_client(app)
    await app[STATE].ready.wait()
    assert "wf-parked" in app[STATE].runs.active  # resumed, parked
    t0 = time.monotonic()
    gate = await drain(app, grace_s=10, hurry=asyncio.Event())
    assert time.monotonic() - t0 < 2 and gate.suspended == []
    assert "wf-parked" not in app[STATE].runs.active
    assert app[STATE].runs.store.load("wf-parked").status == "running"  # still resumable


# -- SIGTERM on a real `flowlift serve` ------------------------------------------------

LONG = "word " * 40  # 200 characters: 50 chunks of 4 at 0.05 s each, about 2.5 s


@step(max_tokens=20)  # the fake echoes the prompt cut to 20 words: about 1.25 s
def slow(text):
    return f"Repeat: {text} {LONG}"


def _serve(port: int, db: Path, log: Path, grace_s: float):  # type: ignore[no-untyped-def]
    return running_proxy("--engine", "fake", "--fake-delay-s", "0.05", "--state-db", str(db),
                         "--grace-s", str(grace_s), log_path=log, port=port,
                         ready_timeout_s=60)


def _stream_chat(base: str, out: dict[str, object], first: threading.Event) -> None:
    body = {"model": "fake-model", "stream": True,  # about 5 s
            "messages": [{"role": "user", "content": LONG * 2}]}
    text, lines = [], []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
                first.set()
    out["text"], out["done"] = "".join(text), lines[-1:] == ["data: [DONE]"] or \
        "data: [DONE]" in lines


def _wait(cond, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_sigterm_finishes_in_flight_work_refuses_new_and_exits_0(tmp_path):
    port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
    base = f"http://127.0.0.1:{port}"
    wf = workflow("drain", base_url=base, reconnect_s=5)
    errors: list[BaseException] = []
    asked, released = threading.Event(), threading.Event()

    @tool
    def hold(text):  # its result reaches the proxy only after SIGTERM
        asked.set()
        released.wait(10)
        return "held"

    def run() -> None:
        try:
            with wf:
                slow(hold(slow("a")))
        except BaseException as exc:  # reported below
            errors.append(exc)

    with _serve(port, db, log, grace_s=20) as (_, proc):
        streamed: dict[str, object] = {}
        first = threading.Event()
        chat = threading.Thread(target=_stream_chat, args=(base, streamed, first))
        runner = threading.Thread(target=run)
        chat.start()
        runner.start()
        assert first.wait(10), "the stream did not start"
        assert asked.wait(15), "the run did not reach its @tool step"
        assert "text" not in streamed, "the stream ended before SIGTERM: nothing in flight"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _wait(lambda: httpx.get(f"{base}/readyz").status_code == 503, 5, "readyz stayed 200")
        released.set()  # the tool's result is posted during the drain, and taken
        refused = httpx.post(f"{base}/v1/chat/completions", json={
            "model": "fake-model", "messages": [{"role": "user", "content": "new"}]})
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert proc.wait(timeout=20) == 0
        waited = time.monotonic() - t0
        chat.join(5)
        runner.join(5)
    assert streamed["status"] == 200 and streamed["done"]
    assert streamed["text"] == f"echo: {LONG * 2}", "the in-flight stream was cut"
    assert not errors, errors
    assert wf.status == "succeeded"
    assert waited < 15, f"exit took {waited:.1f} s after SIGTERM"
    assert RunStore(db).load(wf.run_id).status == "succeeded"  # type: ignore[union-attr]


def test_run_past_the_grace_period_is_checkpointed_and_resumes(tmp_path):
    port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
    wf = workflow("checkpoint", base_url=f"http://127.0.0.1:{port}", reconnect_s=60)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with wf:
                slow(slow(slow("a")))  # three dependent steps of about 1.25 s each
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    with _serve(port, db, log, grace_s=1) as (_, proc):
        thread.start()
        _wait(lambda: len(wf._outputs) >= 1, 20, "the first step did not finish")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        waited = time.monotonic() - t0
    assert waited < 6, f"exit took {waited:.1f} s with a 1 s grace period"
    stored = RunStore(db).load(wf.run_id)
    assert stored is not None and stored.status == "running"  # checkpointed, not finished
    assert not stored.failures(), "the shutdown failed a step"
    done_before = set(stored.outputs())
    assert len(done_before) in (1, 2)
    assert "suspended_runs" in log.read_text()
    with _serve(port, db, log, grace_s=1):  # same state: the run resumes, the SDK reconnects
        thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
    assert wf.status == "succeeded" and len(wf._outputs) == 3
    stored = RunStore(db).load(wf.run_id)
    finished = [d["step_id"] for _, n, d in stored.events if n == "step.finished"]
    assert sorted(finished) == sorted(set(finished)), "a finished step ran again"
    assert done_before <= set(finished)
    assert [n for _, n, _ in stored.events].count("run.resumed") == 1


# -- config errors at start --------------------------------------------------------------


@pytest.fixture(autouse=True)
def _keep_logging(monkeypatch):  # type: ignore[no-untyped-def]
    """In-process `flowlift serve` must not point the process's structlog at capsys's
    stream (closed after the test; later tests would log into it)."""
    monkeypatch.setattr("flowlift.tracing.configure_logging", lambda *a, **k: None)


def _serve_fails(capsys, *args: str) -> str:  # type: ignore[no-untyped-def]
    rc = cli.main(["serve", "--engine", "fake", "--state-db", ":memory:", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if not ln.startswith("{")]  # structlog lines
    assert len(lines) == 1 and lines[0].startswith("flowlift serve: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(("toml", "expect"), [
    ("[backends.a\nkind = 'openai'", "is not valid TOML"),
    ("[servr]\nmax_queue = 3", "servr: Extra inputs are not permitted"),
    ("[backends.a]\nkind = 'openai'\nbase_url = 'http://h/v1'\nap_key_env = 'K'",
     "backends.a.ap_key_env"),
    ("[backends.a]\nkind = 'openai'\nbase_url = 'http://h/v1'\n"
     "api_key_env = 'FLOWLIFT_TEST_UNSET_SECRET'",
     "environment variable FLOWLIFT_TEST_UNSET_SECRET is not set"),
    ("[models.m]\nbackends = ['nope']", "no backend named 'nope'"),
])
def test_bad_config_file_is_one_message_and_exit_2(tmp_path, capsys, monkeypatch, toml,
                                                   expect):
    monkeypatch.delenv("FLOWLIFT_TEST_UNSET_SECRET", raising=False)
    path = tmp_path / "flowlift.toml"
    path.write_text(toml)
    assert expect in _serve_fails(capsys, "--config", str(path))


def test_missing_config_file_and_unopenable_state_db(tmp_path, capsys):
    assert "cannot read config file" in _serve_fails(capsys, "--config",
                                                     str(tmp_path / "none.toml"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = cli.main(["serve", "--engine", "fake", "--port", str(free_port()),  # (not 8470:
                   "--state-db", str(blocker / "state.sqlite")])  # another proxy may have it)
    err = capsys.readouterr().err
    assert rc == 2 and "cannot open the run store" in err and "Traceback" not in err


def test_port_taken_is_one_message_and_exit_2(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        line = _serve_fails(capsys, "--port", str(s.getsockname()[1]))
    assert "cannot listen on 127.0.0.1:" in line


def test_bind_takes_the_port_and_refuses_clients_until_serving():
    import socket

    from flowlift.proxy.lifecycle import bind

    sock = bind("127.0.0.1", 0)
    try:
        with pytest.raises(ConnectionRefusedError):  # not left hanging in a backlog
            socket.create_connection(sock.getsockname(), timeout=2).close()
    finally:
        sock.close()


@pytest.mark.parametrize("args", [("--port", "70000"), ("--port", "http"),
                                  ("--grace-s", "-1"), ("--log-level", "loud")])
def test_bad_flag_exits_2_naming_it(capsys, args):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--engine", "fake", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {args[0]}" in err and "Traceback" not in err


def test_bad_config_from_the_environment_in_a_real_process(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[server]\nmax_queue = 0\n")
    env = {**os.environ, "FLOWLIFT_CONFIG": str(path)}
    proc = subprocess.run([sys.executable, "-m", "flowlift.cli", "serve", "--engine", "fake"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"flowlift serve: {path}: server.max_queue: Input should be greater than or equal "
        "to 1"]


def test_a_second_sigterm_cuts_the_grace_period_short(tmp_path):
    port, log = free_port(), tmp_path / "proxy.log"
    base = f"http://127.0.0.1:{port}"
    with _serve(port, tmp_path / "state.sqlite", log, grace_s=60) as (_, proc):
        body = {"model": "fake-model", "stream": True,
                "messages": [{"role": "user", "content": LONG * 8}]}  # about 20 s
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body,
                          timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _wait(lambda: "drain_started" in log.read_text(), 5, "no drain")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
            waited = time.monotonic() - t0
            with pytest.raises(httpx.HTTPError):  # cut: it could not finish in time
                for _ in lines:
                    pass
    assert waited < 8, f"exit took {waited:.1f} s after the second signal"


def test_a_client_that_leaves_a_whole_answer_stops_its_generation(tmp_path):
    """A non-streamed request whose client gave up holds nothing: the handler is cancelled,
    its generation aborted, so SIGTERM finds nothing in flight and exits at once."""
    port, db, log = free_port(), tmp_path / "state.sqlite", tmp_path / "proxy.log"
    base = f"http://127.0.0.1:{port}"
    with _serve(port, db, log, grace_s=30) as (_, proc):
        body = {"model": "fake-model", "max_tokens": 400,  # ~20 s at 0.05 s a word
                "messages": [{"role": "user", "content": LONG * 20}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/chat/completions", json=body, timeout=0.5)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=25) == 0
        assert time.monotonic() - t0 < 8  # not the 25 s generation nobody waits for


async def test_a_proxy_whose_engine_fails_to_load_stops_with_the_reason():
    from flowlift.proxy import create_app
    from flowlift.proxy.lifecycle import bind, serve

    class Broken(FakeEngine):
        async def start(self) -> None:
            raise RuntimeError("no common block size for 7")

    app = create_app({"m": Broken(["m"])})
    sock = bind("127.0.0.1", free_port())
    reason = await asyncio.wait_for(serve(app, sock, grace_s=1), timeout=20)
    assert reason is not None and "no common block size for 7" in reason


@pytest.mark.parametrize("args", [
    ("--max-concurrency", "0"), ("--max-body-mb", "-1"), ("--max-body-mb", "0"),
    ("--max-body-mb", "lots"), ("--extra-model", ""), ("--batch-prefill-budget", "-1"),
    ("--max-model-len", "0"), ("--max-model-len", "-4"), ("--block-size", "0"),
    ("--speculative-ngram", "-2"), ("--fake-delay-s", "-1"), ("--max-runs", "0"),
    ("--max-queue", "-1"), ("--max-sessions", "x"), ("--batch-cap-when-interactive", "-1")])
def test_nonsense_serve_values_exit_2_with_a_readable_message(capsys, args):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--engine", "fake", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {args[0]}: " in err, err
    assert ("must " in err or "is not a number" in err), err
    assert "Traceback" not in err and "invalid _" not in err


def test_serve_help_says_the_cpu_block_size_rule(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert "multiple of 32" in " ".join(capsys.readouterr().out.split())


def test_trace_dir_must_be_a_directory_or_creatable(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert "not a directory" in _serve_fails(capsys, "--trace-dir", str(a_file))
    assert "cannot create it" in _serve_fails(capsys, "--trace-dir", str(a_file / "sub"))


def test_config_file_that_is_not_utf8_is_one_message(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe")
    line = _serve_fails(capsys, "--config", str(bad))
    assert "is not UTF-8" in line and str(bad) in line


def test_run_checks_its_config_before_starting_a_proxy(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_run, "_get", lambda url: None)  # no proxy answers
    monkeypatch.setattr(cli_run.subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe")
    rc = cli.main(["run", "--config", str(bad), "--log-dir", str(tmp_path), "script.py"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("flowlift run: ") and "not UTF-8" in err


class FinishedScript:
    """The script's process, as ``subprocess.Popen`` gives it: done, status 0."""

    returncode = 0

    def wait(self) -> int:
        return 0

    def poll(self) -> int:
        return 0


def test_run_says_a_running_proxy_ignores_its_engine_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_run, "_get", lambda url: object())  # a proxy answers
    monkeypatch.setattr(cli_run.subprocess, "Popen", lambda *a, **k: FinishedScript())
    monkeypatch.setattr(cli_run, "_say_runs", lambda *a: None)
    assert cli.main(["run", "--config", "x.toml", "--engine", "fake", "script.py"]) == 0
    err = capsys.readouterr().err
    assert "already answers" in err and "--config --engine do not apply" in err
