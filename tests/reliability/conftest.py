"""The reliability suite (``tests/reliability``): faults, kill -9, load, soak, fuzz and
security checks of the proxy, all on 127.0.0.1 and bounded in time.

The soak test runs only when asked: ``pytest tests/reliability --soak`` (its length in
seconds from ``FLOWLIFT_SOAK_S``, default 1800) or ``FLOWLIFT_SOAK_S=N`` alone.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the soak test (FLOWLIFT_SOAK_S seconds, default 1800)")


@pytest.fixture(autouse=True)
def _upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UP_KEY", "sk-upstream-canary-7f3a")


@pytest.fixture
def soak_s(request: pytest.FixtureRequest) -> float:
    """The soak's length in seconds; skips the test unless a soak was asked for."""
    raw = os.environ.get("FLOWLIFT_SOAK_S")
    if not request.config.getoption("--soak", default=False) and raw is None:
        pytest.skip("soak test: run with --soak or FLOWLIFT_SOAK_S=<seconds>")
    return float(raw or 1800)
