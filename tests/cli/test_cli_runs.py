"""Runs you can find and read: ``GET /v1/workflows``, the ``/ui/`` index, ``flowlift runs
/ show / cancel / export`` against a FakeEngine proxy on a real port, and ``show`` /
``trace`` read offline from the state database once the proxy is gone."""

from __future__ import annotations

import csv
import io
import json

import httpx
import pytest

from flowlift import step, workflow
from flowlift.cli import main
from flowlift.testing import running_proxy


@step(max_tokens=12)
def draft(topic):
    return f"Draft a line about {topic}"


@step(max_tokens=12)
def polish(text):
    return f"Polish this: {text}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    db = tmp / "state.sqlite"
    with running_proxy("--engine", "fake", "--state-db", str(db), "--fake-delay-s", "0.01",
                       log_path=tmp / "proxy.log", ready_timeout_s=60) as (base, _):
        ids = []
        for name, topic in (("alpha", "rivers"), ("beta", "hills"), ("alpha", "lakes")):
            with workflow(name, base_url=base) as wf:
                polish(draft(topic))
            ids.append(wf.run_id)
        yield base, db, ids, (tmp / "proxy.log")


def test_list_filters_and_pages(served):
    base, _, ids, _ = served
    everything = httpx.get(f"{base}/v1/workflows").json()
    assert everything["object"] == "list" and not everything["has_more"]
    assert [r["id"] for r in everything["data"]] == ids[::-1]  # newest first
    assert {r["status"] for r in everything["data"]} == {"succeeded"}
    alpha = httpx.get(f"{base}/v1/workflows", params={"name": "alpha"}).json()["data"]
    assert [r["id"] for r in alpha] == [ids[2], ids[0]]
    first = httpx.get(f"{base}/v1/workflows", params={"limit": 2}).json()
    assert first["has_more"] and first["last_id"] == ids[1]
    rest = httpx.get(f"{base}/v1/workflows", params={"limit": 2, "after": first["last_id"]})
    assert [r["id"] for r in rest.json()["data"]] == [ids[0]] and not rest.json()["has_more"]
    assert httpx.get(f"{base}/v1/workflows", params={"state": "failed"}).json()["data"] == []
    assert httpx.get(f"{base}/v1/workflows", params={"limit": 0}).status_code == 400


def test_prompts_are_recorded_resolved(served):
    base, _, ids, _ = served
    doc = httpx.get(f"{base}/v1/workflows/{ids[0]}").json()
    draft_id, polish_id = sorted(doc["prompts"])
    assert doc["prompts"][draft_id] == [{"role": "user", "content": "Draft a line about rivers"}]
    said = doc["outputs"][draft_id]
    assert doc["prompts"][polish_id][0]["content"] == f"Polish this: {said}"
    page = httpx.get(f"{base}/ui/workflows/{ids[0]}").text
    assert "Draft a line about rivers" in page and "<h3>Prompts</h3>" in page


def test_index_page_lists_runs_escaped(served):
    base, _, ids, _ = served
    r = httpx.get(f"{base}/ui/")
    assert r.status_code == 200 and "script-src 'nonce-" in r.headers["Content-Security-Policy"]
    assert all(f'href="/ui/workflows/{i}"' in r.text for i in ids)
    failed = httpx.get(f"{base}/ui/", params={"state": "<b>x"}).text
    assert "<b>x" not in failed and "&lt;b&gt;x" in failed


def test_proxy_logs_each_run_end(served):
    *_, log = served
    ends = [json.loads(ln) for ln in log.read_text().splitlines()
            if '"run_finished"' in ln]
    assert len(ends) >= 3 and all(e["status"] == "succeeded" for e in ends)


def test_cli_runs_show_export(served, capsys):
    base, _, ids, _ = served
    assert main(["runs", "--base-url", base, "--name", "alpha"]) == 0
    out = capsys.readouterr().out
    assert ids[0] in out and ids[2] in out and ids[1] not in out
    assert main(["show", ids[1], "--base-url", base]) == 0
    out = capsys.readouterr().out
    assert f"run {ids[1]} (beta): succeeded" in out and "outputs (2):" in out
    assert main(["export", ids[1], "--base-url", base, "--format", "jsonl"]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert rows[0]["prompt"][0]["content"] == "Draft a line about hills"
    assert all(r["output"] and r["completion_tokens"] > 0 for r in rows)
    assert main(["export", ids[1], "--base-url", base, "--format", "csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert table[0]["prompt"] == "user: Draft a line about hills"
    assert main(["show", "wf-nope", "--base-url", base]) == 1
    assert "no workflow run 'wf-nope'" in capsys.readouterr().err
    assert main(["cancel", ids[1], "--base-url", base]) == 0
    assert "had already finished" in capsys.readouterr().out


def test_show_and_trace_offline_from_the_state_db(served, capsys):
    _, db, ids, _ = served
    gone = "http://127.0.0.1:9"  # nothing answers there
    assert main(["show", ids[0], "--base-url", gone, "--state-db", str(db)]) == 0
    captured = capsys.readouterr()
    assert "reading" in captured.err and f"run {ids[0]} (alpha): succeeded" in captured.out
    assert main(["trace", ids[0], "--base-url", gone, "--state-db", str(db)]) == 0
    assert "wall time" in capsys.readouterr().out
    assert main(["runs", "--base-url", gone, "--state-db", str(db), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["data"]
    assert [r["id"] for r in listed] == ids[::-1]
    # progress from each run's stored log; no deadline, nothing priced (no tier plan)
    assert [(r["steps"], r["done"], r["failed"]) for r in listed] == [(2, 2, 0)] * 3
    assert {(r["deadline_s"], r["spent"]) for r in listed} == {(None, None)}
    assert main(["runs", "--base-url", gone, "--state-db", str(db)]) == 0
    assert "2/2" in capsys.readouterr().out
    assert main(["show", ids[0], "--base-url", gone, "--state-db",
                 str(db.with_name("nope.sqlite"))]) == 2


@pytest.mark.filterwarnings("ignore::flowlift.errors.DeadlineWarning")
def test_a_missed_deadline_is_logged_and_shown_with_reasons(tmp_path, capsys):
    from flowlift.errors import WorkflowFailed

    log = tmp_path / "proxy.log"
    with running_proxy("--engine", "fake", "--state-db", str(tmp_path / "s.sqlite"),
                       "--fake-delay-s", "0.05", log_path=log, ready_timeout_s=60) as (base, _):
        with pytest.raises(WorkflowFailed), workflow("late", base_url=base,
                                                     deadline_s=0.3) as wf:
            polish(draft("a very long topic that takes a while to echo back in full"))
        assert main(["show", wf.run_id, "--base-url", base]) == 0
        out = capsys.readouterr().out
    assert f"run {wf.run_id} (late): failed" in out and "failures (" in out
    assert "deadline of 0.3 s exceeded" in out
    ends = [json.loads(ln) for ln in log.read_text().splitlines()
            if '"run_deadline_missed"' in ln]
    assert [e["event"] for e in ends] == ["run_deadline_missed"]
    assert ends[0]["workflow_id"] == wf.run_id and ends[0]["failed"] >= 1
