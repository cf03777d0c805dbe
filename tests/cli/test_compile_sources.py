"""``flowlift compile`` from a workflow script (recorded, no step run) and from a run
(``--run RUN_ID``: the proxy's ``GET /v1/workflows/{id}/graph``, else the state
database): the same report ``flowlift compile graph.json`` prints for the same graph."""

from __future__ import annotations

import json
import textwrap

import httpx
import pytest

from flowlift import step, workflow
from flowlift.cli import main
from flowlift.errors import UserError
from flowlift.sdk.recording import RecordingStopped, recording
from flowlift.testing import running_proxy

STEPS = '''
from flowlift import step


@step(max_tokens=40)
def extract(doc):
    return f"Key facts of: {doc}"


@step(max_tokens=8)
def classify(facts):
    return f"Label these facts: {facts}"
'''
SCRIPT = '''
import sys
from pathlib import Path

from flowlift import tool, workflow
''' + STEPS + '''

@tool
def shout(text):
    Path(sys.argv[1]).write_text("the tool ran")  # must never happen while recording
    return text.upper()


with workflow("docs", deadline_s=30) as wf:
    label = classify(extract("the text"))
    loud = shout(label)
print("recorded")  # the script's stdout goes to stderr: the report owns stdout
print(loud.value)  # stops recording here
Path(sys.argv[1]).write_text("ran past the read")
'''


def _steps():
    """``extract`` and ``classify`` as the scripts define them."""
    ns: dict = {}
    exec(STEPS, ns)
    return ns["extract"], ns["classify"]


def _graph_json(tmp_path):
    """The same workflow recorded the documented way (``submit=False``)."""
    extract, classify = _steps()
    with workflow("docs", deadline_s=30, submit=False) as wf:
        classify(extract("the text"))
    path = tmp_path / "graph.json"
    path.write_text(json.dumps(wf.graph().to_wire()))
    return path


def test_a_script_compiles_without_running_and_stops_at_its_first_read(tmp_path, capsys):
    script = tmp_path / "wf.py"
    script.write_text(SCRIPT)
    marker = tmp_path / "marker.txt"
    assert main(["compile", "--local", "--json", str(script), "--", str(marker)]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert not marker.exists()  # neither the tool nor the line after the read ran
    assert "recorded" in err and "recording stopped at `.value` of step" in err
    line = SCRIPT.splitlines().index("print(loud.value)  # stops recording here") + 1
    assert f"wf.py:{line}" in err  # the script's line that read the value
    assert report["name"] == "docs" and report["steps"] == 3
    assert [n["step_id"] for n in report["nodes"]] == ["extract_1", "classify_1", "shout_1"]


def test_a_script_gives_the_report_its_graph_json_gives(tmp_path, capsys):
    script = tmp_path / "wf.py"
    script.write_text(SCRIPT.replace("    loud = shout(label)\n", "")
                            .replace("print(loud.value)", "print(label.value)"))
    assert main(["compile", "--local", str(script), "--", str(tmp_path / "m")]) == 0
    from_script = capsys.readouterr().out
    assert main(["compile", "--local", str(_graph_json(tmp_path))]) == 0
    assert capsys.readouterr().out == from_script and "classify" in from_script


def test_a_read_inside_the_block_stops_recording_with_the_steps_before_it(tmp_path, capsys):
    script = tmp_path / "open.py"
    script.write_text(textwrap.dedent('''
        from flowlift import step, workflow

        @step(max_tokens=8)
        def ask(q):
            return q

        with workflow("grows") as wf:
            first = ask("one")
            if first.get() == "yes":  # needs a run: recording stops here
                ask("two")
            ask("three")
    '''))
    assert main(["compile", "--local", "--json", str(script)]) == 0
    out, err = capsys.readouterr()
    assert "recording stopped at a read inside the block" in err and "open.py:10" in err
    assert "ask_2" not in out and "ask_1" in out


def test_a_script_that_records_nothing_or_raises_fails_plainly(tmp_path, capsys):
    empty = tmp_path / "empty.py"
    empty.write_text("print('no workflow here')\n")
    assert main(["compile", "--local", str(empty)]) == 2
    assert "recorded no workflow step" in capsys.readouterr().err
    broken = tmp_path / "broken.py"
    broken.write_text("raise ValueError('bad input file')\n")
    assert main(["compile", "--local", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "ValueError: bad input file" in err and "raised ValueError" in err
    assert main(["compile", "--local"]) == 2
    assert "give a graph JSON file" in capsys.readouterr().err


def test_outside_recording_a_record_only_read_still_raises_user_error():
    @step
    def ask(q):
        return q

    with pytest.raises(UserError), workflow("rec", submit=False):
        ask("x").get()
    with recording(), pytest.raises(RecordingStopped), workflow("rec"):
        ask("x").get()


def test_compile_a_run_from_the_proxy_then_from_the_state_database(tmp_path, capsys):
    db = tmp_path / "state.sqlite"
    with running_proxy("--engine", "fake", "--state-db", str(db), "--fake-delay-s", "0.01",
                       log_path=tmp_path / "proxy.log", ready_timeout_s=60) as (base, _):
        extract, classify = _steps()
        with workflow("essay", base_url=base) as wf:
            classify(extract("rivers"))
        graph = httpx.get(f"{base}/v1/workflows/{wf.run_id}/graph").json()
        assert [n["id"] for n in graph["nodes"]] == ["extract_1", "classify_1"]
        missing = httpx.get(f"{base}/v1/workflows/wf-nope/graph")
        assert missing.status_code == 404 and missing.json()["error"]["message"]
        (tmp_path / "g.json").write_text(json.dumps(graph))
        assert main(["compile", "--base-url", base, "--run", wf.run_id]) == 0
        from_run = capsys.readouterr().out
        assert main(["compile", "--base-url", base, str(tmp_path / "g.json")]) == 0
        assert capsys.readouterr().out == from_run and "classify" in from_run
        assert main(["compile", "--base-url", base, "--run", "wf-nope"]) == 1
        assert "wf-nope" in capsys.readouterr().err
    local = ["compile", "--base-url", base, "--state-db", str(db)]
    assert main([*local, "--run", wf.run_id]) == 0
    offline = capsys.readouterr().out
    assert main([*local, "--local", str(tmp_path / "g.json")]) == 0
    assert capsys.readouterr().out == offline
