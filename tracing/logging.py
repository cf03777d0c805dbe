"""structlog set-up: JSON logs carrying the workflow id and step id via contextvars,
the current OpenTelemetry trace and span ids, and no secrets.

Every line gets ``workflow_id`` / ``step_id`` where they are bound (:func:`bind_run`),
``trace_id`` / ``span_id`` (hex, as W3C ``traceparent`` writes them) when a span is
current, so a log line can be found from its trace and back. :class:`RedactSecrets`
runs last before rendering: fields whose name says they hold a credential
(``authorization``, ``api_key``, ``token``, ``password``, ``secret``, ``cookie``...),
and any string holding one of the configured secrets (the proxy's API keys, the
upstream keys), are replaced with ``[redacted]``, exception text included.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, TextIO

import structlog
from opentelemetry import trace

REDACTED = "[redacted]"
_SECRET_NAME = re.compile(r"authorization|api[-_]?keys?|token|password|passwd|secret|cookie"
                          r"|credential", re.IGNORECASE)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")


class RedactSecrets:
    """A structlog processor that removes credentials from an event (see module doc).

    Args:
        secrets: exact secret values to mask wherever they appear (shorter than 4
            characters: ignored, they would mask ordinary text).
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def _clean(self, value: Any, depth: int = 0) -> Any:
        if isinstance(value, str):
            for secret in self.secrets:
                if secret in value:
                    value = value.replace(secret, REDACTED)
            return _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", value)
        if depth > 4:
            return value
        if isinstance(value, dict):
            return {k: REDACTED if isinstance(k, str) and _SECRET_NAME.search(k)
                    else self._clean(v, depth + 1) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._clean(v, depth + 1) for v in value)
        return value

    def __call__(self, logger: Any, method: str,
                 event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key in list(event):
            if _SECRET_NAME.search(key):
                event[key] = REDACTED
            else:
                event[key] = self._clean(event[key])
        return event


def add_trace_ids(logger: Any, method: str,
                  event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Add the current OpenTelemetry span's ``trace_id`` and ``span_id`` (hex)."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


def configure_logging(level: str = "info", json: bool = True, *,
                      secrets: Iterable[str] = (), file: TextIO | None = None,
                      cache_loggers: bool = True) -> None:
    """Configure structlog once for the process (the proxy calls this at start).

    Args:
        level: the lowest level written (``debug``, ``info``, ``warning``...).
        json: one JSON object per line (else a plain console format).
        secrets: values never to write (the config's keys).
        file: where lines go (default stderr).
        cache_loggers: structlog's ``cache_logger_on_first_use`` (tests that configure
            logging more than once turn it off).
    """
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json
        else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            add_trace_ids,
            RedactSecrets(secrets),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=file or sys.stderr),
        cache_logger_on_first_use=cache_loggers,
    )


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


@contextmanager
def bind_run(**ids: str) -> Iterator[None]:
    """Bind ``workflow_id`` / ``step_id`` (or any ids) to every log line in this context."""
    with structlog.contextvars.bound_contextvars(**ids):
        yield
