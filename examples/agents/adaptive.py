"""Graphs that decide on the proxy: an early-exit vote and a Nexa-shaped debate.

Eight multiple-choice questions with known answers, each answered two ways:

* **vote** (early exit, LAMaS-style): five voters answer (a short reason, then a
  choice); ``wf.quorum(*votes, k=3, agree_on="choice")`` resolves as soon as three
  agree and the proxy cancels the other voters mid-generation.
* **debate** (Nexa-shaped): three agents answer in parallel (``wf.map`` over the
  roster), a router step's contract output names the sparse set of "agent i should read
  agent j" edges, one propagation round runs only those edges (revision steps with
  ``when=field(route.a1_reads_a2)``), and the final answer is the majority of each
  agent's last word.

Each can run three ways (``--variant``): ``proxy`` (the decisions in the graph, made on
the proxy), ``static`` (the full graph: every voter, every edge, no router) and
``app`` (the same decisions made by the app in an open run: it awaits the values and
records the next steps, one round trip per decision). ``bench/adaptive.py`` runs all
three on one engine.

    flowlift run examples/agents/adaptive.py [--shape vote|debate|both] [--variant proxy]
    flowlift run --engine fake examples/agents/adaptive.py   # without a model

Prints per shape and variant: accuracy, tokens (prompt + generated, cancelled tries
counted for what they generated), makespan, the run's skipped steps and its failed
ones (a step whose output broke its contract counts as no answer from it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

if __package__ in (None, ""):  # run as a script: make `examples.agents` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flowlift import (
    ProxyUnavailable,
    StepFailed,
    StepWasSkipped,
    Workflow,
    WorkflowFailed,
    field,
    step,
    workflow,
)

Letter = Literal["A", "B", "C", "D"]
VOTERS, QUORUM, AGENTS = 5, 3, 3


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    answer: Letter


QUESTIONS: tuple[Question, ...] = (
    Question("What is 7 + 5? A) 10 B) 12 C) 13 D) 11", "B"),
    Question("Which planet is closest to the Sun? A) Venus B) Earth C) Mercury D) Mars", "C"),
    Question("How many legs does a spider have? A) 8 B) 6 C) 10 D) 4", "A"),
    Question("What is the capital of France? A) Rome B) Madrid C) Berlin D) Paris", "D"),
    Question("What is 9 x 3? A) 21 B) 27 C) 24 D) 18", "B"),
    Question("Which gas do plants take in? A) Oxygen B) Helium C) Carbon dioxide "
             "D) Nitrogen", "C"),
    Question("How many days are in a week? A) 7 B) 5 C) 6 D) 8", "A"),
    Question("What is 15 - 6? A) 8 B) 7 C) 10 D) 9", "D"),
)


class Vote(BaseModel):
    reason: str = Field(max_length=60)
    choice: Letter


class Route(BaseModel):
    """Which agent should read which (a sparse set of edges, agents 1..3)."""

    a1_reads_a2: bool
    a1_reads_a3: bool
    a2_reads_a1: bool
    a2_reads_a3: bool
    a3_reads_a1: bool
    a3_reads_a2: bool


EDGES = [(i, j) for i in range(1, AGENTS + 1) for j in range(1, AGENTS + 1) if i != j]
SYSTEM = ("Answer the multiple-choice question. Give a one-sentence reason, then the "
          "letter of the right option.")


@step(output=Vote, max_tokens=100, temperature=0.8)
def voter(question: str, who: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{SYSTEM} You are voter {who}."},
            {"role": "user", "content": question}]


@step(output=Vote, max_tokens=100, temperature=0.8)
def debater(persona: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{SYSTEM} You are {persona}."},
            {"role": "user", "content": question}]


@step(output=Route, max_tokens=80)
def router(question: str, answers: Any) -> str:
    return (f"Question: {question}\nThe agents' answers, agents 1 to {AGENTS}: {answers}\n"
            "Which agent should read which other agent's answer before a second try? "
            "Pick only the pairs that disagree and would gain from reading.")


@step(output=Vote, max_tokens=80)
def revise(question: str, mine: Any, theirs: Any) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{question}\nYour answer: {mine}\nAnother "
                                        f"agent's answer: {theirs}\nAnswer again."}]


PERSONAS = ["a careful mathematician", "a quick-thinking student", "a skeptical teacher"]


@dataclass(slots=True)
class Outcome:
    """One shape run one way over the questions."""

    shape: str
    variant: str
    answers: list[str | None] = dc_field(default_factory=list)
    makespan_s: float = 0.0
    tokens: int = 0
    skipped: int = 0
    failed: int = 0
    run_id: str | None = None

    @property
    def correct(self) -> int:
        return sum(a == q.answer for a, q in zip(self.answers, QUESTIONS, strict=False))


def _choice(value: Any) -> str | None:
    return value.choice if isinstance(value, Vote) else None


def _said(var: Any) -> str | None:
    """A step's letter after the run; None when it failed (a broken contract: no vote)
    or was skipped."""
    try:
        return _choice(var.value)
    except (StepFailed, StepWasSkipped):
        return None


def _majority(choices: list[str | None]) -> str | None:
    counted = Counter(c for c in choices if c is not None)
    return counted.most_common(1)[0][0] if counted else None


def _tokens(wf: Workflow) -> int:
    return sum(int(r.get("prompt_tokens", 0)) + int(r.get("completion_tokens", 0))
               for r in wf.trace if r.get("type") == "step")


# -- the vote ---------------------------------------------------------------------------

def vote_graph(wf: Workflow, q: Question, variant: str) -> Callable[[], str | None]:
    """Record one question's vote; returns how to read its answer after the run."""
    votes = [voter(q.text, i) for i in range(1, VOTERS + 1)]
    if variant == "proxy":
        agreed = wf.quorum(*votes, k=QUORUM, agree_on="choice")
        return lambda: _said(agreed)
    return lambda: _majority([_said(v) for v in votes])


async def vote_by_app(wf: Workflow, q: Question) -> str | None:
    """The app's early exit in an open run: ``QUORUM`` voters, then one more at a time
    until ``QUORUM`` agree (a round trip per decision)."""
    votes = [voter(q.text, i) for i in range(1, QUORUM + 1)]
    choices = [await _awaited(v) for v in votes]
    while True:
        best, count = (Counter(c for c in choices if c).most_common(1) or [(None, 0)])[0]
        if count >= QUORUM or len(choices) == VOTERS:
            return best
        choices.append(await _awaited(voter(q.text, len(choices) + 1)))


async def _awaited(var: Any) -> str | None:
    """``await var``'s letter in an open run; None when the step failed."""
    try:
        return _choice(await var)
    except StepFailed:
        return None


# -- the debate -------------------------------------------------------------------------

def _edge(route: Any, i: int, j: int) -> Any:
    return getattr(route, f"a{i}_reads_a{j}")


def debate_graph(wf: Workflow, q: Question, variant: str) -> Callable[[], str | None]:
    """Record one question's debate; returns how to read its answer after the run."""
    roster = wf.input(PERSONAS, name="roster")
    answers = wf.map(debater, roster, q.text, max_items=AGENTS)
    firsts = [getattr(answers, str(i - 1)) for i in range(1, AGENTS + 1)]
    if variant == "proxy":
        route = router(q.text, answers)
        revised = {(i, j): revise(q.text, firsts[i - 1], firsts[j - 1],
                                  when=field(_edge(route, i, j))) for i, j in EDGES}
    else:
        revised = {(i, j): revise(q.text, firsts[i - 1], firsts[j - 1]) for i, j in EDGES}

    def final() -> str | None:
        said = [_said(a) for a in firsts]
        for (i, _), var in revised.items():
            said[i - 1] = _said(var) or said[i - 1]
        return _majority(said)
    return final


async def debate_by_app(wf: Workflow, q: Question) -> str | None:
    """The router's decision read by the app, which records only the chosen edges."""
    roster = wf.input(PERSONAS, name="roster")
    answers = wf.map(debater, roster, q.text, max_items=AGENTS)
    try:
        route = await router(q.text, answers)
    except StepFailed:  # no route (a broken contract, a failed agent): no revision
        route = None
    firsts = [getattr(answers, str(i - 1)) for i in range(1, AGENTS + 1)]
    chosen = [(i, j) for i, j in EDGES
              if route is not None and getattr(route, f"a{i}_reads_a{j}")]
    revised = {(i, j): revise(q.text, firsts[i - 1], firsts[j - 1]) for i, j in chosen}
    said = [await _awaited(a) for a in firsts]
    for (i, _), var in revised.items():
        said[i - 1] = await _awaited(var) or said[i - 1]
    return _majority(said)


# -- running ----------------------------------------------------------------------------

GRAPHS: dict[str, Callable[[Workflow, Question, str], Callable[[], str | None]]] = {
    "vote": vote_graph, "debate": debate_graph}
BY_APP: dict[str, Callable[[Workflow, Question], Awaitable[str | None]]] = {
    "vote": vote_by_app, "debate": debate_by_app}


async def run_shape(shape: str, variant: str, questions: list[Question],
                    base_url: str | None = None) -> Outcome:
    """Every question of one shape, run one way, in one run."""
    out = Outcome(shape, variant)
    t0 = time.monotonic()
    wf = workflow(f"{shape}-{variant}", base_url=base_url, workflow_class="interactive")
    try:
        async with wf:
            if variant == "app":
                out.answers = list(await asyncio.gather(*(BY_APP[shape](wf, q)
                                                          for q in questions)))
            else:
                readers = [GRAPHS[shape](wf, q, variant) for q in questions]
    except WorkflowFailed:  # a step broke its contract: counted as no answer from it
        out.failed = len(wf.failures)
    out.makespan_s = time.monotonic() - t0
    if variant != "app":
        out.answers = [read() for read in readers]
    out.tokens, out.skipped, out.run_id = _tokens(wf), len(wf.skipped), wf.run_id
    return out


def line(o: Outcome, n: int) -> str:
    return (f"  {o.shape:<6} {o.variant:<6} accuracy {o.correct}/{n}  tokens {o.tokens:>6}  "
            f"makespan {o.makespan_s:6.2f} s  skipped {o.skipped:>3}  failed {o.failed:>2}  "
            f"run {o.run_id}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", choices=("vote", "debate", "both"), default="both")
    parser.add_argument("--variant", choices=("proxy", "static", "app", "all"),
                        default="proxy")
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args(argv)
    questions = list(QUESTIONS[:args.limit])
    shapes = ["vote", "debate"] if args.shape == "both" else [args.shape]
    variants = ["proxy", "static", "app"] if args.variant == "all" else [args.variant]
    print(f"adaptive: {len(questions)} questions; vote: {VOTERS} voters, quorum {QUORUM}; "
          f"debate: {AGENTS} agents, a router, one propagation round")
    try:
        for shape in shapes:
            for variant in variants:
                print(line(asyncio.run(run_shape(shape, variant, questions)),
                           len(questions)), flush=True)
    except ProxyUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
