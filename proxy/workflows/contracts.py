"""Checking a step's output against its contract, after generation.

Constrained decoding (when the engine has it) makes violations rare, but the check
always runs: a contract is never dropped silently (case W3). A failed check is a
:class:`~flowlift.errors.ContractError` naming the step, the model, the attempt and
every validation error; :func:`feedback` turns it into the messages of a retry
(Instructor-style re-asking, done here in the proxy where the inputs are at hand).
"""

from __future__ import annotations

import json
import re
from typing import Any, TypedDict

import jsonschema

from flowlift.errors import ContractError
from flowlift.graph import Contract
from flowlift.local_engine.base import ChatMessage


class _Where(TypedDict):
    """Where a check failed, as :func:`_fail` takes it."""

    step_id: str | None
    model: str | None
    attempt: int | None


def _fail(what: str, errors: list[str], *, step_id: str | None, model: str | None,
          attempt: int | None) -> ContractError:
    where = f"step {step_id!r}" + (f" on model {model!r}" if model else "") \
        + (f", attempt {attempt}" if attempt else "")
    return ContractError(f"{where}: {what}", step_id=step_id, errors=errors, model=model,
                         attempt=attempt)


def check_output(contract: Contract | None, text: str, *, step_id: str | None = None,
                 model: str | None = None, attempt: int | None = None) -> Any:
    """Validate ``text`` against ``contract`` and return the output value.

    Returns:
        ``text`` when there is no contract; the parsed JSON value for a JSON Schema
        contract; the label (surrounding whitespace removed) for a choices contract; the
        text for a regex contract (it must match whole, ``re.fullmatch``).

    Raises:
        ContractError: naming the step, the model, the attempt and listing every
            validation error.
    """
    where: _Where = {"step_id": step_id, "model": model, "attempt": attempt}
    if contract is None:
        return text
    if contract.choices is not None:
        label = text.strip()
        if label in contract.choices:
            return label
        raise _fail(f"output {label[:80]!r} is not one of the labels "
                    f"{list(contract.choices)}", [f"not in {list(contract.choices)}"], **where)
    if contract.regex is not None:
        if re.fullmatch(contract.regex, text):
            return text
        raise _fail(f"output {text[:80]!r} does not match the regex {contract.regex!r}",
                    [f"does not match {contract.regex!r}"], **where)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:  # ("Unterminated string starting at": no 2nd "at")
        at = f"{exc.msg} char {exc.pos}" if exc.msg.endswith(" at") else \
            f"{exc.msg} at char {exc.pos}"
        raise _fail(f"output is not valid JSON ({at}; was max_tokens too small?)",
                    [f"not valid JSON: {at}"], **where) from None
    validator = jsonschema.Draft202012Validator(contract.json_schema or {})
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
              for e in validator.iter_errors(value)]
    if errors:
        raise _fail("output violates its JSON Schema: " + "; ".join(errors[:5]), errors,
                    **where)
    return value


def _expected(contract: Contract) -> str:
    if contract.choices is not None:
        return "exactly one of: " + ", ".join(contract.choices)
    if contract.regex is not None:
        return f"text matching the regular expression {contract.regex}"
    return "one JSON value that satisfies this JSON Schema: " + json.dumps(
        contract.json_schema, separators=(",", ":"))[:2000]


def feedback(contract: Contract, output: str, error: ContractError) -> list[ChatMessage]:
    """The turns a contract retry appends to the step's messages: the rejected output as
    the assistant's turn, then a user turn naming the validation errors (case T3)."""
    problems = "\n".join(f"- {e}" for e in error.errors[:8]) or f"- {error.message}"
    return [ChatMessage("assistant", output),
            ChatMessage("user", "That answer was rejected by the output check:\n"
                        f"{problems}\nAnswer again with {_expected(contract)}. "
                        "Reply with the answer only.")]
