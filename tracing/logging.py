"""structlog set-up: JSON logs carrying the workflow id and step id via contextvars."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog


def configure_logging(level: str = "info", json: bool = True) -> None:
    """Configure structlog once for the process (the proxy calls this at start)."""
    renderer: Any = (structlog.processors.JSONRenderer() if json
                     else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


@contextmanager
def bind_run(**ids: str) -> Iterator[None]:
    """Bind ``workflow_id`` / ``step_id`` (or any ids) to every log line in this context."""
    with structlog.contextvars.bound_contextvars(**ids):
        yield
