"""The public test doubles must produce what real engines would: contract-valid output."""

from __future__ import annotations

import re
from typing import Annotated

import jsonschema
import pytest
from pydantic import BaseModel, Field, StringConstraints

from flowlift.testing import example_for_pattern, example_for_schema


@pytest.mark.parametrize("pattern", [
    r"^[a-z][a-z0-9 ]{1,20}[a-z0-9]$", r"^(Provides|Implements) [^\n\]\[{}]*$",
    r"\d{3}-\w+", r"^a|b$", r"[^abc]+x?", r"^(?:ab|cd){2,3}\s$", r"^[A-Z]{2}[0-9]{4}$"])
def test_pattern_examples_match(pattern):
    assert re.search(pattern, example_for_pattern(pattern))


class Inner(BaseModel):
    code: Annotated[str, StringConstraints(pattern=r"^[A-Z]{3}$")]
    weight: float = Field(ge=2.5)


class Outer(BaseModel):
    name: str = Field(min_length=3)
    items: list[Inner] = Field(min_length=2)
    tag: str | None = None
    flag: bool


def test_schema_examples_validate():
    schema = Outer.model_json_schema()
    value = example_for_schema(schema)
    jsonschema.validate(value, schema)
    Outer.model_validate(value)
