"""The compiler's faces: POST /v1/workflows:compile and `flowlift compile`."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

from flowlift.cli import main

PREAMBLE = "You are a careful assistant that answers in one short sentence. " * 4
GRAPH = {"name": "faces", "deadline_s": 60, "nodes": [
    *[{"kind": "llm", "id": f"q{i}", "messages": [
        {"role": "system", "content": [{"text": PREAMBLE}]},
        {"role": "user", "content": [{"text": f"question {i}"}]}]} for i in range(3)],
    {"kind": "llm", "id": "join", "messages": [{"role": "user", "content": [
        {"ref": "q0"}, {"ref": "q1"}, {"ref": "q2"}]}]}]}


async def test_compile_endpoint_uses_the_engines_tokenizer_and_measured_costs(client):
    r = await client.post("/v1/workflows:compile", json=GRAPH)
    assert r.status == 200
    report = await r.json()
    assert report["steps"] == 4 and report["levels"] == 2
    assert report["critical_path"][-1] == "join"
    assert report["prefix_groups"][0]["steps"] == 3
    assert report["cost_models"]["fake-model"]["source"] == "default"
    # run it once: the proxy calibrates this machine's engines (an embedded one here),
    # the next report uses the calibrated figures
    await (await client.post("/v1/workflows", json=GRAPH)).text()
    report = await (await client.post("/v1/workflows:compile", json=GRAPH)).json()
    assert report["cost_models"]["fake-model"]["source"] == "calibrated"
    assert report["cost_models"]["fake-model"]["calibration"] != 1.0
    bad = await client.post("/v1/workflows:compile", json={"nodes": [
        {"kind": "llm", "id": "a", "messages": [{"role": "user", "content": [{"ref": "z"}]}]}]})
    assert bad.status == 400 and bad.headers["Content-Type"].startswith("application/json")


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_cli_compile_local_table_and_json(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(GRAPH))
    code, out, _ = _cli("compile", "--local", str(path))
    assert code == 0 and "critical path" in out and "3 steps share" in out
    code, out, _ = _cli("compile", "--local", "--json", str(path))
    assert code == 0 and json.loads(out)["steps"] == 4
    path.write_text(json.dumps({"nodes": []}))
    code, _, err = _cli("compile", "--local", str(path))
    assert code == 1 and "nodes" in err


async def test_cli_compile_asks_the_proxy(client, tmp_path):
    path = tmp_path / "g.json"
    path.write_text(json.dumps(GRAPH))
    base = str(client.make_url("")).rstrip("/")
    code, out, err = await asyncio.to_thread(_cli, "compile", "--base-url", base, str(path))
    assert code == 0 and "fake-model" in out and "no proxy" not in err


def test_cli_compile_price_flag_is_checked(tmp_path, capsys):
    import pytest

    path = tmp_path / "g.json"
    path.write_text(json.dumps(GRAPH))
    for bad in ("m=abc", "=1", "m=-1", "m=nan", "m"):
        with pytest.raises(SystemExit) as exc:
            main(["compile", "--local", "--price", bad, str(path)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "argument --price" in err and "MODEL=PRICE" in err
        assert "Traceback" not in err
    code, out, err = _cli("compile", "--local", "--price", "nope=1", "--price",
                          "default=0.5", str(path))
    assert code == 0 and "critical path" in out
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warnings) == 1 and "--price nope=1" in warnings[0] and "'nope'" in warnings[0]
