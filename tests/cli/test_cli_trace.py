"""``flowlift trace RUN_ID`` and ``flowlift run``'s progress, against a proxy on a
FakeEngine on a real port (output captured: not a terminal, so no colour codes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from flowlift import step, tool, workflow
from flowlift.cli import main
from flowlift.testing import free_port, running_proxy


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    log = tmp_path_factory.mktemp("trace") / "proxy.log"
    with running_proxy("--engine", "fake", "--state-db", ":memory:", "--fake-delay-s", "0.02",
                       log_path=log, ready_timeout_s=60) as (base, _):
        yield base


@step(max_tokens=10)
def first(doc):
    return f"First look at {doc} now"


@tool
def wait_a_bit(x):
    time.sleep(0.2)
    return "waited"


@step(max_tokens=30)
def last(a, b):
    return f"Then {a} and {b} into more words than before, please"


@step(max_tokens=1)
def aside(x):
    return f"aside {x}"


def test_trace_prints_the_waterfall(proxy, capsys):
    with workflow("traced", base_url=proxy) as wf:
        a = first("doc")
        last(a, wait_a_bit(a))
        aside("x")
    assert main(["trace", wf.run_id, "--base-url", proxy]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # captured, not a terminal
    lines = out.splitlines()
    assert lines[0].startswith(f"run {wf.run_id} 'traced': succeeded, wall ")
    rows = {ln[2:].split()[0]: ln for ln in lines[2:6]}
    assert set(rows) == {"first_1", "wait_a_bit_1", "last_1", "aside_1"}
    assert {s for s, ln in rows.items() if ln.startswith("* ")} == {
        "first_1", "wait_a_bit_1", "last_1"}
    assert all(len(ln.split("|")[1]) == 60 for ln in rows.values())  # 60 columns when piped
    assert "t" in rows["wait_a_bit_1"].split("|")[1] and "=" in rows["last_1"].split("|")[1]
    assert "critical path (measured): first_1 -> wait_a_bit_1 -> last_1" in out
    assert "tool_wait " in out and "wall time" in lines[-1]

    assert main(["trace", wf.run_id, "--base-url", proxy, "--color", "always",
                 "--width", "30"]) == 0
    coloured = capsys.readouterr().out
    assert "\x1b[35m" in coloured and "\x1b[0m" in coloured


def test_trace_errors_are_clear(proxy, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no state database to fall back on
    monkeypatch.setenv("FLOWLIFT_CACHE_DIR", str(tmp_path))
    assert main(["trace", "wf-unknown", "--base-url", proxy]) == 1
    assert "no workflow run 'wf-unknown'" in capsys.readouterr().err
    assert main(["trace", "wf-x", "--base-url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "no proxy answers" in capsys.readouterr().err


SCRIPT = textwrap.dedent("""
    from flowlift import step, workflow

    @step(max_tokens=30)
    def item(x):
        return f"item {x} with a handful of extra words"

    with workflow("batch", workflow_class="batch") as wf:
        outs = [item(i) for i in range(12)]
    print("done", len([o.value for o in outs]))
""")


@pytest.mark.parametrize("flag", [[], ["--no-progress"]])
def test_flowlift_run_shows_progress_on_stderr(proxy, tmp_path, flag):
    script = tmp_path / "batch.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "FLOWLIFT_PROGRESS"}
    out = subprocess.run([sys.executable, "-m", "flowlift.cli", "run", "--base-url", proxy,
                          *flag, str(script)], capture_output=True, text=True, timeout=120,
                         env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done 12"
    progress = [ln for ln in out.stderr.splitlines() if ln.startswith("flowlift: batch [")]
    if flag:
        assert progress == []
    else:  # not a terminal: plain lines, the last one final
        assert progress and "12/12 done" in progress[-1] and "\r" not in out.stderr


@pytest.mark.parametrize("width", ["0", "-5", "19", "wide"])
def test_trace_width_has_a_sane_minimum(capsys, width):
    with pytest.raises(SystemExit) as exc:
        main(["trace", "wf-x", "--width", width, "--base-url", "http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --width" in err and ">= 20" in err
    assert "Traceback" not in err
