"""The command line as a new user meets it (issue 15, item 8): ``flowlift`` alone prints
help, ``--version``, help text on every option, ``flowlift init`` writes a starter that
runs."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys

import pytest

from flowlift import __version__
from flowlift.cli import build_parser, main
from flowlift.cli.init import write_starter
from flowlift.testing import free_port


def test_flowlift_alone_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flowlift") and "serve" in out and "init" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"flowlift {__version__}"


def _parsers(parser: argparse.ArgumentParser, name: str = "flowlift"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_option_and_argument_has_help():
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}"
               for name, parser in _parsers(build_parser()) for a in parser._actions
               if not isinstance(a, argparse._SubParsersAction)
               and (a.help is None or a.help == argparse.SUPPRESS or not a.help.strip())]
    assert not missing, f"no help text: {missing}"
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    assert all(c.help for c in commands._choices_actions), "every command has a line"


def test_init_writes_a_starter_and_keeps_existing_files(tmp_path, capsys):
    assert main(["init", str(tmp_path / "proj")]) == 0
    assert (tmp_path / "proj" / "workflow.py").is_file()
    assert "[backends.local]" in (tmp_path / "proj" / "flowlift.toml").read_text()
    assert "flowlift run --engine fake workflow.py" in capsys.readouterr().out
    (tmp_path / "proj" / "workflow.py").write_text("# mine")
    written = dict(write_starter(tmp_path / "proj"))
    assert written == {tmp_path / "proj" / "workflow.py": False,
                       tmp_path / "proj" / "flowlift.toml": False}
    assert (tmp_path / "proj" / "workflow.py").read_text() == "# mine"
    write_starter(tmp_path / "proj", force=True)
    assert "with workflow(" in (tmp_path / "proj" / "workflow.py").read_text()


def test_the_starter_runs_as_written(tmp_path):
    """The command `flowlift init` prints first: a proxy on the fake engine is started for
    the script and stopped after it."""
    write_starter(tmp_path)
    env = {**os.environ, "FLOWLIFT_PROGRESS": "0"}
    out = subprocess.run([sys.executable, "-m", "flowlift.cli", "run", "--engine", "fake",
                          "--base-url", f"http://127.0.0.1:{free_port()}", "workflow.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].split()[0] in ("question", "statement"), out.stdout
    assert "-> echo: Title:" in lines[0]
    assert (tmp_path / "runs" / "starter.jsonl").is_file()
    # issue 38, item 9: the proxy stopped with the command: no page URL that cannot answer
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("flowlift: run wf-")]
    assert "read: `flowlift show wf-" in line and "/ui/workflows/" not in line


async def test_the_starter_prints_what_succeeded_when_a_step_fails(aiohttp_client, tmp_path):
    """Issue 38, item 1: a step that fails (here every extract: its JSON is cut off) is
    named, the rows print what did succeed, no traceback, exit status 1."""
    import asyncio

    from flowlift.proxy import create_app
    from flowlift.proxy.state import STATE
    from flowlift.testing import FakeEngine, default_responder

    def respond(request):
        if any("What is it about?" in m.content for m in request.messages):
            return '{"topic": "cut off'
        return default_responder(request)

    app = create_app({"fake-model": FakeEngine(["fake-model"], responder=respond)})
    client = await aiohttp_client(app)
    await app[STATE].ready.wait()
    write_starter(tmp_path)
    env = {**os.environ, "FLOWLIFT_PROGRESS": "0",
           "FLOWLIFT_BASE_URL": str(client.make_url("")).rstrip("/")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "workflow.py", cwd=tmp_path, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    stdout, stderr = out.decode(), err.decode()
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "step(s) failed" in stderr
    rows = stdout.splitlines()[:2]
    assert all(r.split()[0] in ("question", "statement") for r in rows), stdout
    assert all("-> FAILED (skipped" in r for r in rows), stdout  # summarize read extract


def test_help_is_plain_text_without_rest_markup(capsys):
    """Issue 38, item 9: ``--help`` shows no ````code```` or ``:mod:`` roles."""
    for argv in ([], ["init", "--help"]):
        with contextlib.suppress(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "flowlift" in out and "``" not in out and ":mod:" not in out, out
