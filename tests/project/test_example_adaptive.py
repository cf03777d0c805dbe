"""The adaptive example (examples/agents/adaptive.py): the vote and the debate, each
run the three ways on a scripted FakeEngine -- the proxy's decisions skip and cancel
what the static graph runs, and reach the answers the app's own decisions reach."""

from __future__ import annotations

import json

import pytest

from examples.agents import adaptive

QS = list(adaptive.QUESTIONS[:2])  # B, C


def _respond(request):
    text = request.messages[-1].content
    system = request.messages[0].content
    q = next(q for q in adaptive.QUESTIONS if q.text in text)
    if "Which agent should read" in text:  # only agent 3 reads agent 1
        return json.dumps({f"a{i}_reads_a{j}": (i, j) == (3, 1)
                           for i, j in adaptive.EDGES})
    wrong = "voter 2" in system or "voter 5" in system or "skeptical" in system
    choice = "A" if wrong and "Another agent" not in text else q.answer
    reason = "slow " * 60 if "voter 5" in system else "because"
    return json.dumps({"reason": reason.strip()[:150], "choice": choice})


@pytest.mark.parametrize("shape", ["vote", "debate"])
async def test_three_ways_reach_the_answers_and_the_proxy_skips_work(client, engine, shape):
    engine.responder = _respond
    engine.delay_s = 0.002
    base = str(client.make_url("")).rstrip("/")
    outs = {v: await adaptive.run_shape(shape, v, QS, base) for v in ("static", "proxy", "app")}
    for o in outs.values():
        assert o.correct == len(QS), (o.variant, o.answers)
        assert "accuracy 2/2" in adaptive.line(o, len(QS))
    assert outs["static"].skipped == 0 and outs["proxy"].skipped > 0
    assert outs["proxy"].tokens < outs["static"].tokens
    if shape == "debate":  # 6 edges each; the router picked one
        assert outs["proxy"].skipped == 5 * len(QS)
