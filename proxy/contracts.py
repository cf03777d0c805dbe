"""Checking a step's output against its contract, after generation.

Constrained decoding (when the engine has it) makes violations rare, but the check
always runs: a contract is never dropped silently (case W3).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from flowlift.errors import ContractError
from flowlift.graph import Contract


def check_output(contract: Contract | None, text: str, *, step_id: str | None = None) -> Any:
    """Validate ``text`` against ``contract`` and return the output value.

    Returns:
        ``text`` when there is no contract; the parsed JSON value for a JSON Schema
        contract; the label (surrounding whitespace removed) for a choices contract.

    Raises:
        ContractError: naming the step and listing every validation error.
    """
    if contract is None:
        return text
    if contract.choices is not None:
        label = text.strip()
        if label in contract.choices:
            return label
        raise ContractError(f"step {step_id!r}: output {label[:80]!r} is not one of the "
                            f"labels {list(contract.choices)}", step_id=step_id,
                            errors=[f"not in {list(contract.choices)}"])
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ContractError(f"step {step_id!r}: output is not valid JSON ({exc.msg} at "
                            f"char {exc.pos}; was max_tokens too small?)", step_id=step_id,
                            errors=[exc.msg]) from None
    validator = jsonschema.Draft202012Validator(contract.json_schema or {})
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
              for e in validator.iter_errors(value)]
    if errors:
        raise ContractError(f"step {step_id!r}: output violates its JSON Schema: "
                            + "; ".join(errors[:5]), step_id=step_id, errors=errors)
    return value
