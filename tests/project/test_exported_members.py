"""Each public package's ``__all__`` is sorted and names exactly what the package exports
(after httpx's tests/test_exported_members.py)."""

from __future__ import annotations

import importlib
import re
import types

import pytest

PACKAGES = ["flowlift", "flowlift.sdk", "flowlift.proxy", "flowlift.local_engine",
            "flowlift.tracing", "flowlift.cli", "flowlift.testing"]
EXPORTED_DUNDERS = {"__version__"}


def isort_key(name: str) -> tuple[int, list[str | int]]:
    """The order ruff's RUF022 keeps ``__all__`` in (isort-style): SCREAMING_CASE names,
    then CamelCase names, then the rest; within each, a natural sort (``v2`` < ``v10``)."""
    cased = [c for c in name if c.isalpha()]
    if cased and all(c.isupper() for c in cased):
        kind = 0
    elif name[:1].isupper():
        kind = 1
    else:
        kind = 2
    return kind, [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def test_isort_key_orders_like_ruff() -> None:
    names = ["step", "Workflow", "__version__", "STATE", "ProxyConfig", "STAGES", "v10", "v2"]
    assert sorted(names, key=isort_key) == ["STAGES", "STATE", "ProxyConfig", "Workflow",
                                            "__version__", "step", "v2", "v10"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_names_every_public_member(name: str) -> None:
    package = importlib.import_module(name)
    exported = list(package.__all__)
    assert exported == sorted(exported, key=isort_key)
    # submodules become attributes of their package once imported: they are not exports
    public = {member for member, value in vars(package).items()
              if (not member.startswith("_") or member in EXPORTED_DUNDERS)
              and not isinstance(value, types.ModuleType)}
    assert sorted(public, key=isort_key) == exported
