"""Server-sent events as bytes, for forwarding a stream without re-encoding it.

The proxy does not interpret a forwarded stream; it needs only two facts about it:
where each event ends (so an in-band error is never spliced into the middle of one,
and the first event can be awaited under the first-token timeout), and whether the
stream reached its end marker (case S6): ``data: [DONE]`` (or the Responses API's
last event). A ``finish_reason`` is not the end: with ``n > 1`` other choices may still
be running, and with ``include_usage`` the usage chunk follows it. Both are byte
searches over what arrived, per the WHATWG event-stream format: an event ends at a
blank line (``\\n\\n``, ``\\r\\n\\r\\n`` or ``\\r\\r``).
Forwarding raw bytes keeps the upstream's framing and
every multibyte character exactly as sent (case S4), writes each arrival in one write
(case S5), and costs a fraction of decoding and re-encoding every event. Where
flowlift does read events (upstream-backed workflow steps), httpx-sse parses them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import orjson

# each a whole line (see _line): no "^", which would make re try every position
_DONE = re.compile(rb"data: ?\[DONE\]\s*$", re.MULTILINE)  # OpenAI chat/completions
_TERMINAL = re.compile(  # the Responses API's last event
    rb"event: ?(?:response\.(?:completed|incomplete|failed)|error)\s*$", re.MULTILINE)


def _line(pattern: re.Pattern[bytes], events: bytes) -> bool:
    """Whether ``pattern`` matches ``events`` from the start of a line (a search for its
    literal start, then a look back: ``^`` in a multi-line pattern costs ~10x more)."""
    for match in pattern.finditer(events):
        at = match.start()
        if at == 0 or events[at - 1] in b"\r\n":
            return True
    return False


def complete_prefix(buffer: bytes) -> int:
    """Length of the longest prefix of ``buffer`` that is whole events (0: none yet)."""
    if b"\r" not in buffer:  # (most send \n only: one separator to look for)
        i = buffer.rfind(b"\n\n")
        return i + 2 if i >= 0 else 0
    end = 0
    for sep in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        i = buffer.rfind(sep)
        if i >= 0:
            end = max(end, i + len(sep))
    return end


_DATA_LINE = re.compile(rb"^data:", re.MULTILINE)


def has_data(events: bytes) -> bool:
    """Whether whole ``events`` hold a model event (a ``data:`` line), not only
    comments (``: keep-alive``) or blank lines: only such an event counts as a first
    token or restarts an idle timer (cases N4, N6)."""
    return events.startswith(b"data:") or _DATA_LINE.search(events) is not None


def finished(events: bytes) -> bool:
    """Whether whole ``events`` include the stream's end marker."""
    # cheap substring tests first: every chunk of a stream passes through here
    return _done(events) or (b"event:" in events and _line(_TERMINAL, events))


def _done(events: bytes) -> bool:
    """Whether a line of ``events`` is ``data: [DONE]`` (found from the end, where it is)."""
    at = events.rfind(b"[DONE]")
    while at >= 0:
        start = max(events.rfind(b"\n", 0, at), events.rfind(b"\r", 0, at)) + 1
        if _DONE.match(events, start):
            return True
        at = events.rfind(b"[DONE]", 0, at)
    return False


def has_error(events: bytes) -> bool:
    """Whether whole ``events`` include an in-band error event (a JSON object with an
    ``error`` member, or an ``event: error``)."""
    if b'"error"' not in events and b"event: error" not in events:
        return False
    if re.search(rb"^event: ?error\s*$", events, re.MULTILINE):
        return True
    for data in data_fields(events):
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict) and doc.get("error") is not None:
            return True
    return False


_BLOCK_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")


def block_at(events: bytes, at: int) -> tuple[int, int]:
    """``(start, end)`` of the block of whole ``events`` that holds byte ``at`` (the
    blank line after it left out)."""
    start, end = 0, len(events)
    for sep in _SEPARATORS if b"\r" in events else _SEPARATORS[:1]:  # (most send \n only)
        before = events.rfind(sep, 0, at)
        if before >= 0:
            start = max(start, before + len(sep))
        after = events.find(sep, at)
        if after >= 0:
            end = min(end, after)
    return start, end


def data_of(block: bytes) -> str | None:
    """The ``data`` of one event's block (multi-line data joined by ``\\n``), or None
    when it has no ``data:`` line."""
    lines = [line[5:].removeprefix(b" ") for line in block.splitlines()
             if line.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8", "replace") if lines else None


def data_fields(events: bytes) -> Iterator[str]:
    """The ``data`` of each event in whole ``events`` (multi-line data joined by ``\\n``)."""
    for block in _BLOCK_END.split(events):
        data = data_of(block)
        if data is not None:
            yield data


_EVENT = re.compile(rb"(.*?)(\r\n\r\n|\n\n|\r\r)", re.DOTALL)


def without_usage(events: bytes) -> bytes:
    """Whole ``events`` less the usage the client did not ask for (case N3): an event
    that is only usage (``choices: []``) is left out, and a chunk that carries a usage
    object beside its choices is re-encoded without it (``"usage": null`` stays: it
    says nothing). Events without a usage pass byte-identical.
    """
    if b'"usage"' not in events:  # the common case: one substring test
        return events
    if b"\r" not in events:  # (most send \n only: split where the pattern would, at C speed)
        return b"".join(_strip_event(block) if b'"usage"' in block else block + b"\n\n"
                        for block in events.split(b"\n\n")[:-1])
    out = []
    for match in _EVENT.finditer(events):
        event = match.group(0)
        if b'"usage"' in event:
            event = _strip_event(match.group(1))
        out.append(event)
    return b"".join(out)


def _strip_event(block: bytes) -> bytes:
    data = data_of(block)
    try:
        doc = orjson.loads(data) if data is not None else None
    except orjson.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict) or not doc.get("usage"):
        return block + b"\n\n"
    if not doc.get("choices"):
        return b""  # the usage chunk itself
    doc.pop("usage")
    return b"data: " + orjson.dumps(doc) + b"\n\n"
