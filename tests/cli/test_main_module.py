"""`python -m flowlift` is the `flowlift` command: same help, same exit codes."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest


def _console_script() -> Path:
    """The installed `flowlift` script (next to this interpreter: the same venv)."""
    (ep,) = entry_points(group="console_scripts", name="flowlift")
    assert ep.value == "flowlift.cli:main"
    script = Path(sys.executable).with_name("flowlift")
    assert script.is_file(), f"no console script at {script}: install flowlift in this venv"
    return script


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # the environment is inherited: a PYTHONPATH that points flowlift at another tree
    # applies to both commands alike
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("args", [["--help"], ["compile", "--help"]])
def test_help_is_the_console_scripts(args: list[str], tmp_path: Path) -> None:
    module = _run([sys.executable, "-m", "flowlift", *args], tmp_path)
    script = _run([str(_console_script()), *args], tmp_path)
    assert module.returncode == script.returncode == 0, module.stderr
    assert module.stdout.startswith("usage: flowlift ")
    assert module.stdout == script.stdout


def test_exit_code_passes_through(tmp_path: Path) -> None:
    """A command that fails (here: `compile` of a missing file, exit 2 from main's return)
    fails the same way under `python -m flowlift`."""
    missing = str(tmp_path / "missing.json")
    module = _run([sys.executable, "-m", "flowlift", "compile", "--local", missing], tmp_path)
    script = _run([str(_console_script()), "compile", "--local", missing], tmp_path)
    assert module.returncode == script.returncode == 2
    assert module.stderr == script.stderr
    assert "cannot read" in module.stderr
