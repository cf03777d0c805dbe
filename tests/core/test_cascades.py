"""Model cascades: escalation on contract failure, unretryable errors and a confidence
floor; failure rates learned per (step, model) and persisted; the compiler's expected
cascade cost; transport retries in one layer only (case T3) on a fake upstream."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flowlift import step, workflow
from flowlift.compiler import CompileOptions, compile_graph
from flowlift.dataflow import validate
from flowlift.errors import ContextLengthExceeded, EngineError, GraphError, UserError
from flowlift.escalation import OutcomeCounts, expected_cost
from flowlift.graph import Graph, LLMNode
from flowlift.proxy import ProxyConfig, create_app
from flowlift.proxy.config import parse_config
from flowlift.proxy.state import STATE
from flowlift.proxy.store.outcomes import StepOutcomes
from flowlift.report import format_report
from flowlift.testing import FakeEngine
from tests.sdk.test_contract_retries import run as run_graph
from tests.upstream_fake import FakeUpstream, chunk, sse_bytes

LABELS = ["spam", "ham"]


def llm(node_id, text, **extra):
    return {"kind": "llm", "id": node_id, "name": node_id.split("_")[0],
            "messages": [{"role": "user", "content": [{"text": text}]}], **extra}


async def run(client, nodes):
    return await run_graph(client, *nodes)


async def two_models(aiohttp_client, small, large, tmp_path=None):
    config = ProxyConfig(state_path=tmp_path / "state.sqlite") if tmp_path else None
    app = create_app({"small": small, "large": large}, config)
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


def failing_every(n_bad_of_10: int, bad: str = "maybe"):
    """A small model that answers badly for items whose number mod 10 < n_bad_of_10."""
    def respond(request):
        item = int(request.messages[0].content.split("#")[1])
        return bad if item % 10 < n_bad_of_10 else "spam"
    return respond


# -- the graph ---------------------------------------------------------------------------

def test_sdk_model_list_is_a_cascade_on_the_wire():
    @step(model=["small", "mid", "large"], output=None, retries=1, min_confidence=0.4)
    def label(x):
        return f"label {x}"

    with workflow("c", submit=False) as wf:
        label("a")
    node = wf.graph().node_map()["label_1"]
    assert node.cascade == ("small", "mid", "large") and node.model == "small"
    assert node.min_confidence == 0.4 and node.retries == 1
    assert wf.graph().to_wire()["nodes"][0]["cascade"] == ["small", "mid", "large"]
    with pytest.raises(UserError, match="cascade"):
        step(model=[])
    with pytest.raises(UserError, match="min_confidence"):
        step(model=["a", "b"], min_confidence=1.5)


def test_unknown_cascade_models_are_graph_errors():
    graph = Graph.model_validate({"nodes": [llm("a", "x", cascade=["small", "huge"]),
                                            llm("b", "y", cascade=["tiny"])]})
    with pytest.raises(GraphError) as err:
        validate(graph, {"small", "large"})
    assert len(err.value.problems) == 2 and "'huge'" in err.value.problems[0]
    with pytest.raises(ValueError, match="first model"):
        LLMNode.model_validate(llm("a", "x", model="large", cascade=["small", "large"]))


def test_graphs_without_the_new_fields_still_parse():
    old = {"version": "1", "nodes": [{"kind": "llm", "id": "a", "model": "m", "messages": [
        {"role": "user", "content": [{"text": "x"}]}], "contract": {"choices": ["p"]}}]}
    graph = Graph.model_validate(old)
    node = graph.nodes[0]
    assert node.cascade is None and node.retries == 0 and node.models() == ("m",)
    wire = graph.to_wire()["nodes"][0]  # readable by proxies that predate the new fields
    assert not {"retries", "cascade", "min_confidence"} & set(wire)
    assert "regex" not in wire["contract"]
    assert Graph.model_validate(graph.to_wire()) == graph


def test_steps_with_different_cascades_are_not_merged_as_identical():
    nodes = [llm("a_1", "same"), llm("a_2", "same", cascade=["small", "large"]),
             llm("a_3", "same", retries=2), llm("a_4", "same")]
    assert compile_graph(Graph.model_validate({"nodes": nodes})).merged_into == {"a_4": "a_1"}


# -- escalation --------------------------------------------------------------------------

async def test_contract_failures_escalate_after_the_models_retries(aiohttp_client):
    small = FakeEngine(["small"], responder=failing_every(3))
    large = FakeEngine(["large"])  # answers the first label
    client = await two_models(aiohttp_client, small, large)
    nodes = [llm(f"label_{i}", f"item #{i}", cascade=["small", "large"], retries=1,
                 contract={"choices": LABELS}) for i in range(10)]
    done, failed, steps = await run(client, nodes)
    assert not failed and all(v == "spam" for v in done.values())
    escalated = [s for s in steps.values() if len(s["attempts"]) > 1]
    assert len(escalated) == 3
    for s in escalated:
        assert [(a["model"], a["outcome"]) for a in s["attempts"]] == [
            ("small", "contract_failed"), ("small", "contract_failed"), ("large", "ok")]
        assert s["model"] == "large"
    assert len(small.requests) == 7 + 3 * 2 and len(large.requests) == 3
    # the escalated request carries the step's own messages, not the small model's retry
    assert [m.role for m in large.requests[0].messages] == ["user"]


async def test_the_last_models_failure_is_the_steps_contract_error(aiohttp_client):
    small = FakeEngine(["small"], responder=lambda r: "maybe")
    large = FakeEngine(["large"], responder=lambda r: "perhaps")
    client = await two_models(aiohttp_client, small, large)
    _, failed, steps = await run(client, [llm("s_1", "item #1", cascade=["small", "large"],
                                              contract={"choices": LABELS})])
    assert "on model 'large', attempt 2" in failed["s_1"]
    assert [a["model"] for a in steps["s_1"]["attempts"]] == ["small", "large"]


async def test_unretryable_errors_escalate_at_once(aiohttp_client):
    small = FakeEngine(["small"], fail_with=ContextLengthExceeded("too long for small"))
    large = FakeEngine(["large"])
    client = await two_models(aiohttp_client, small, large)
    done, _, steps = await run(client, [llm("s_1", "item #1", cascade=["small", "large"],
                                            retries=3, contract={"choices": LABELS})])
    assert done["s_1"] == "spam" and len(small.requests) == 1
    assert [a["outcome"] for a in steps["s_1"]["attempts"]] == ["error", "ok"]


async def test_transport_errors_fail_the_step_without_escalating(aiohttp_client):
    small = FakeEngine(["small"], fail_with=EngineError("small is down"))
    large = FakeEngine(["large"])
    client = await two_models(aiohttp_client, small, large)
    _, failed, _ = await run(client, [llm("s_1", "item #1", cascade=["small", "large"],
                                          retries=2, contract={"choices": LABELS})])
    assert "small is down" in failed["s_1"] and not large.requests


async def test_outputs_under_the_confidence_floor_escalate(aiohttp_client):
    # "ham" is a token the small model is unsure of (p = e^-3), "spam" one it is sure of
    small = FakeEngine(["small"], responder=lambda r: "ham" if "#1" in r.messages[0].content
                       else "spam", logprob=lambda t: -3.0 if "ham" in t else -0.05)
    large = FakeEngine(["large"], responder=lambda r: "spam", logprob=lambda t: -4.0)
    client = await two_models(aiohttp_client, small, large)
    nodes = [llm(f"s_{i}", f"item #{i}", cascade=["small", "large"], min_confidence=0.5,
                 contract={"choices": LABELS}) for i in (1, 2)]
    done, failed, steps = await run(client, nodes)
    assert not failed and done == {"s_1": "spam", "s_2": "spam"}
    first = steps["s_1"]["attempts"]
    assert [(a["model"], a["outcome"]) for a in first] == [("small", "low_confidence"),
                                                            ("large", "ok")]
    assert first[0]["confidence"] == pytest.approx(0.0498, abs=1e-3)
    assert first[1]["confidence"] is None  # the last model's output is kept, unchecked
    assert steps["s_2"]["attempts"][0]["confidence"] == pytest.approx(0.951, abs=1e-3)
    assert small.requests[0].sampling.logprobs == 0 and large.requests[0].sampling.logprobs is None


# -- learned failure rates ---------------------------------------------------------------

async def test_failure_rates_are_learned_persisted_and_fed_to_the_compiler(aiohttp_client,
                                                                          tmp_path):
    small = FakeEngine(["small"], responder=failing_every(3))
    large = FakeEngine(["large"])
    client = await two_models(aiohttp_client, small, large, tmp_path)
    nodes = [llm(f"label_{i}", f"item #{i}", cascade=["small", "large"],
                 contract={"choices": LABELS}, params={"max_tokens": 4}) for i in range(20)]
    await run(client, nodes)
    before = client.app[STATE].runs.outcomes.counts("label", "small")
    assert before == OutcomeCounts(items=20, failures=6, attempts=20)
    report = await (await client.post("/v1/workflows:compile", json={"nodes": nodes[:1]})).json()
    (c,) = report["cascades"]
    assert c["models"] == ["small", "large"] and c["observed"] == [20, 6]
    assert c["failure_rates"] == [pytest.approx(7 / 22, abs=1e-4), pytest.approx(1 / 8)]
    await client.close()
    reopened = StepOutcomes(tmp_path / "state.sqlite")  # survives the proxy
    assert reopened.counts("label", "small") == before
    assert reopened.counts("label", "large") == OutcomeCounts(6, 0, 6)


def test_expected_cascade_cost_follows_the_failure_rates():
    small, large = OutcomeCounts(98, 18, 98), OutcomeCounts(18, 0, 18)  # 0.19, 0.05
    assert expected_cost([1.0, 10.0], [small, large]) == pytest.approx(1 + 0.19 * 10)
    retried = OutcomeCounts(10, 4, 15)  # 1.5 attempts per item
    assert expected_cost([2.0, 10.0], [retried, large]) == pytest.approx(3 + 5 / 12 * 10)
    assert OutcomeCounts().failure_rate == 0.5  # the prior before any observation


def test_compile_reports_the_cascade_against_the_large_model_alone():
    graph = Graph.model_validate({"nodes": [
        llm(f"label_{i}", f"classify text {i}", cascade=["small", "large"],
            contract={"choices": LABELS}) for i in range(4)] + [llm("free", "plain text")]})
    seen = {("label", "small"): OutcomeCounts(100, 10, 100),
            ("label", "large"): OutcomeCounts(10, 1, 10)}
    opts = CompileOptions(outcomes=lambda s, m: seen.get((s, m), OutcomeCounts()),
                          price={"small": 0.1, "large": 2.0}.get)
    report = compile_graph(graph, opts).report
    c = report.cascades[0]
    tokens = report.nodes[0].prompt_tokens + report.nodes[0].output_tokens
    rate = 11 / 102
    assert c.expected_price == pytest.approx(tokens / 1000 * (0.1 + rate * 2.0), rel=1e-3)
    assert c.last_only_price == pytest.approx(tokens / 1000 * 2.0, rel=1e-3)
    totals = report.cascade_totals
    assert totals["expected_price"] == pytest.approx(4 * c.expected_price, rel=1e-4)
    text = format_report(report)
    assert "cascades: 4 step(s) (small -> large): expected cost" in text
    assert "with the last model alone (0.16x)" in text and "small 11% of 100" in text
    unpriced_plan = compile_graph(graph, CompileOptions())
    unpriced = unpriced_plan.report
    assert "expected_price" not in unpriced.cascade_totals
    assert "s (no prices)" in format_report(unpriced)
    # a cascade's expected time is its node's cost (the engine to itself; the rows
    # show it with the four labels sharing the engine)
    assert unpriced_plan.cost_ms["label_0"] == pytest.approx(
        unpriced.cascades[0].expected_ms, abs=0.1)
    assert unpriced.nodes[0].est_ms >= unpriced.cascades[0].expected_ms


def test_flowlift_compile_prices_flag(tmp_path):
    graph = {"nodes": [llm("label_1", "classify", cascade=["small", "large"],
                           contract={"choices": LABELS})]}
    path = tmp_path / "g.json"
    path.write_text(json.dumps(graph))
    cmd = [sys.executable, "-m", "flowlift.cli", "compile", "--local", "--state-db",
           str(tmp_path / "none.sqlite"), "--price", "small=0.1", "--price", "large=1",
           str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "expected cost" in out.stdout and "with the last model alone (0.60x)" in out.stdout
    bad = subprocess.run([*cmd[:-1], "--price", "large", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "MODEL=PRICE" in bad.stderr  # argparse: exit 2


async def test_prices_come_from_the_config_file(aiohttp_client):
    cfg = parse_config({"backends": {"local": {"kind": "embedded"}}, "models": {
        "small": {"backends": ["local"], "price_per_1k_tokens": 0.1},
        "large": {"backends": ["local"], "price_per_1k_tokens": 1.5},
        "free": {"backends": ["local"]}}})
    assert cfg.prices() == {"small": 0.1, "large": 1.5}
    app = create_app({"m": FakeEngine(["m"])}, file_config=cfg)
    assert app[STATE].prices == {"small": 0.1, "large": 1.5}
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    graph = {"nodes": [llm("s_1", "x", cascade=["small", "large"])]}
    report = await (await client.post("/v1/workflows:compile", json=graph)).json()
    totals = report["cascade_totals"]
    assert totals["expected_price"] < totals["last_only_price"]  # priced by the config
    cheap = [llm("s_1", "x", cascade=["small", "free"])]  # an unpriced model: time only
    report = await (await client.post("/v1/workflows:compile", json={"nodes": cheap})).json()
    assert "expected_price" not in report["cascade_totals"]


# -- one transport-retry layer (T3) on a fake upstream -----------------------------------

def _answer(text: str):
    return FakeUpstream.stream(sse_bytes(chunk({"content": text}), chunk({}, "stop")))


async def _upstream_proxy(aiohttp_client, aiohttp_server, fake, max_attempts):
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    app = create_app({}, file_config=parse_config({
        "backends": {"up": {"kind": "openai", "base_url": url}},
        "models": {"up": {"backends": ["up"], "max_attempts": max_attempts}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    return client


async def test_t3_transport_failures_are_retried_in_exactly_one_layer(aiohttp_client,
                                                                      aiohttp_server):
    """Case T3: a 503 is retried by the proxy's attempts layer; a contract failure by the
    step's retry loop; neither stacks on the other."""
    fake = FakeUpstream([FakeUpstream.json({"error": {"message": "busy"}}, status=503),
                         _answer("AB"), _answer("42")])
    client = await _upstream_proxy(aiohttp_client, aiohttp_server, fake, max_attempts=2)
    done, failed, steps = await run(client, [llm("s_1", "number?", model="up", retries=3,
                                                 contract={"regex": r"\d+"})])
    assert not failed and done["s_1"] == "42"
    assert len(fake.received) == 3  # 503 -> transport retry; "AB" -> contract retry
    assert [a["outcome"] for a in steps["s_1"]["attempts"]] == ["contract_failed", "ok"]
    last = fake.received[2].json()["messages"]
    assert last[-2] == {"role": "assistant", "content": "AB"}
    assert "does not match" in last[-1]["content"]


async def test_t3_a_dead_upstream_is_tried_max_attempts_times_not_more(aiohttp_client,
                                                                       aiohttp_server):
    fake = FakeUpstream([FakeUpstream.json({"error": {"message": "down"}}, status=503)])
    client = await _upstream_proxy(aiohttp_client, aiohttp_server, fake, max_attempts=2)
    _, failed, steps = await run(client, [llm("s_1", "number?", model="up", retries=3,
                                              contract={"regex": r"\d+"})])
    assert "s_1" in failed and len(fake.received) == 2  # not 2 x (1 + retries)
    assert [a["outcome"] for a in steps["s_1"]["attempts"]] == ["error"]


async def test_an_upstream_context_error_escalates_along_the_cascade(aiohttp_client,
                                                                     aiohttp_server):
    fake = FakeUpstream([FakeUpstream.json({"error": {
        "message": "maximum context length is 8 tokens", "type": "invalid_request_error",
        "code": "context_length_exceeded"}}, status=400)])
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    large = FakeEngine(["large"])
    app = create_app({"large": large}, file_config=parse_config({
        "backends": {"up": {"kind": "openai", "base_url": url}},
        "models": {"up": {"backends": ["up"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    done, _, steps = await run(client, [llm("s_1", "long doc", cascade=["up", "large"],
                                            retries=2, contract={"choices": LABELS})])
    assert done["s_1"] == "spam" and len(fake.received) == 1
    assert "maximum context length" in steps["s_1"]["attempts"][0]["error"]


def test_a_cascade_model_that_cannot_enforce_the_contract_is_a_chain_break():
    graph = Graph.model_validate({"nodes": [llm("s_1", "x", cascade=["small", "plain"],
                                                contract={"regex": "a+"})]})
    report = compile_graph(graph, CompileOptions(enforces=lambda m: m != "plain")).report
    assert [b.reason for b in report.breaks] == [
        "contract not enforceable by plain's backend: checked after generation"]


async def test_an_upstream_content_filter_finish_escalates(aiohttp_client, aiohttp_server):
    fake = FakeUpstream([FakeUpstream.stream(sse_bytes(chunk({"content": "I can"}),
                                                       chunk({}, "content_filter")))])
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    large = FakeEngine(["large"])
    app = create_app({"large": large}, file_config=parse_config({
        "backends": {"up": {"kind": "openai", "base_url": url}},
        "models": {"up": {"backends": ["up"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    done, _, steps = await run(client, [llm("s_1", "x", cascade=["up", "large"], retries=2,
                                            contract={"choices": LABELS})])
    assert done["s_1"] == "spam" and len(fake.received) == 1  # not retried on "up"
    assert "content filter" in steps["s_1"]["attempts"][0]["error"]


def _with_logprobs(text: str, logprob: float | None):
    lp = None if logprob is None else {"content": [{"token": text, "logprob": logprob,
                                                    "top_logprobs": []}]}
    return FakeUpstream.stream(sse_bytes(
        {**chunk({"content": text}), "choices": [{"index": 0, "delta": {"content": text},
                                                  "logprobs": lp, "finish_reason": None}]},
        chunk({}, "stop")))


@pytest.mark.parametrize(("logprob", "models", "note"), [
    (-2.0, ["up", "large"], None),  # p = 0.135 < 0.5: escalates
    (-0.1, ["up"], None),  # p = 0.905: kept
    (None, ["up"], "no logprobs")])  # the floor cannot apply, and the trace says so
async def test_an_upstreams_logprobs_feed_the_confidence_floor(aiohttp_client, aiohttp_server,
                                                              logprob, models, note):
    fake = FakeUpstream([_with_logprobs("ham", logprob)])
    url = str((await aiohttp_server(fake.app())).make_url("/v1"))
    app = create_app({"large": FakeEngine(["large"])}, file_config=parse_config({
        "backends": {"up": {"kind": "openai", "base_url": url}},
        "models": {"up": {"backends": ["up"]}}}))
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    _, _, steps = await run(client, [llm("s_1", "x", cascade=["up", "large"],
                                         min_confidence=0.5, contract={"choices": LABELS})])
    tries = steps["s_1"]["attempts"]
    assert [t["model"] for t in tries] == models
    assert fake.received[0].json()["logprobs"] is True
    assert (note in (tries[0]["error"] or "")) if note else tries[-1]["outcome"] == "ok"
