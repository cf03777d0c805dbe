"""``flowlift init [DIR]``: a starter workflow and its proxy config, ready to run.

Writes ``DIR/workflow.py`` (three steps and a ``@tool``: extract JSON, classify into
labels, a tool in plain Python, a summary) and ``DIR/flowlift.toml`` (the embedded
engine serving the model names the steps use). Existing files are kept unless
``--force``. Then::

    flowlift run --config flowlift.toml workflow.py                 # the embedded model
    flowlift run --engine fake workflow.py                          # no model, instant
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flowlift.cli.common import plain

WORKFLOW = '''"""A starter flowlift workflow.

    flowlift run --config flowlift.toml workflow.py     # on the embedded model
    flowlift run --engine fake workflow.py              # no model: instant, fake answers

Inside `with workflow(...)` every step call returns a Semantic Variable (a placeholder):
put it whole into later prompts (f-strings) or pass it to steps and tools; read `.value`
after the block. Python on a value belongs in a @tool.
"""

import sys
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from flowlift import StepFailed, WorkflowFailed, step, tool, workflow

Term = Annotated[str, Field(max_length=24)]   # bounded items: a small model rambles


class Facts(BaseModel):
    topic: str = Field(max_length=80)
    key_terms: list[Term] = Field(max_length=3)


@step(output=Facts, max_tokens=128, retries=1)      # JSON, parsed into Facts
def extract(text):
    return [{"role": "system", "content": "You extract facts. Answer in JSON."},
            {"role": "user", "content": f"Text:\\n{text}\\nWhat is it about?"}]


@step(output=Literal["question", "statement"], max_tokens=8)
def classify(text):
    return f"Is this a question or a statement? Text: {text}"


@tool                                              # runs here, in your Python process
def headline(facts: Facts) -> str:
    return facts.topic.strip().capitalize() or "(no topic)"


@step(max_tokens=64)
def summarize(facts, kind, title):
    return (f"Title: {title}. It is a {kind}. Key terms: {facts.key_terms}. "
            "Summarize it in one sentence:")


def shown(var):
    """A step's value, or why it has none (reading a failed step's value raises)."""
    try:
        return var.value
    except StepFailed as exc:
        return f"FAILED ({exc.kind}: {str(exc)[:120]})"


TEXTS = [
    "SQLite is a small, fast, self-contained SQL database engine.",
    "How do I read a CSV file with the Python standard library?",
]

rows = []
try:
    with workflow("starter", trace_path="runs/starter.jsonl") as wf:
        for text in TEXTS:
            facts, kind = extract(text), classify(text)
            rows.append((text, kind, summarize(facts, kind, headline(facts))))
except WorkflowFailed as exc:                      # the steps that succeeded still print
    print(f"{len(exc.failures)} step(s) failed; `flowlift show {exc.run_id}` says why",
          file=sys.stderr)

for text, kind, summary in rows:
    print(f"{shown(kind):<9} {text[:40]:<40} -> {shown(summary)}")
print(wf.report())
sys.exit(1 if wf.failures else 0)
'''

CONFIG = '''# The proxy config of workflow.py: `flowlift run --config flowlift.toml workflow.py`.
# Model names the steps use map to backends: the embedded engine here (the default
# model), or an OpenAI-compatible upstream:
#
#   [backends.openai]
#   kind = "openai"
#   base_url = "https://api.openai.com/v1"
#   api_key_env = "OPENAI_API_KEY"          # read from the environment, never stored
#   [models."gpt-4o-mini"]
#   backends = ["openai"]

[backends.local]
kind = "embedded"
'''

FILES = {"workflow.py": WORKFLOW, "flowlift.toml": CONFIG}


def write_starter(folder: Path, *, force: bool = False) -> list[tuple[Path, bool]]:
    """Write the starter files into ``folder`` (created if missing).

    Returns:
        ``(path, written)`` per file; ``written`` is False for a file that existed and
        was kept (without ``force``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in FILES.items():
        path = folder / name
        keep = path.exists() and not force
        if not keep:
            path.write_text(text, encoding="utf-8")
        out.append((path, not keep))
    return out


def cmd_init(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    for path, written in write_starter(folder, force=args.force):
        print(f"{'wrote' if written else 'kept (exists; --force overwrites)'} {path}")
    where = "" if folder.resolve() == Path.cwd().resolve() else f"cd {folder} && "
    print(f"next: {where}flowlift run --engine fake workflow.py   (no model)\n"
          f"      {where}flowlift run --config flowlift.toml workflow.py")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("init", help="write a starter workflow.py and flowlift.toml",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", nargs="?", default=".",
                   help="folder to write into (default: the current one)")
    p.add_argument("--force", action="store_true",
                   help="overwrite workflow.py and flowlift.toml when they exist")
    p.set_defaults(func=cmd_init)
