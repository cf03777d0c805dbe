"""An MCP ``CallToolResult`` as the outcome the model reads (pure: no I/O).

A model's tool result is text (an OpenAI chat ``tool`` message takes text parts only,
and a Responses ``mcp_call.output`` is a string), so each content block is passed on as
far as text can carry it (MCP specification, "Tools: tool result"):

* ``text``: as it is; an embedded ``resource`` with text: its text;
* ``image`` / ``audio``: a note of its MIME type and size (the bytes cannot reach a
  text-only model; the note says they were there, never silently nothing);
* ``resource_link`` and an embedded binary ``resource``: its URI, name and MIME type;
* a result with no content but ``structuredContent``: the structured JSON itself
  (a server may return only that; the model must not get an empty result).

``isError`` makes the text the outcome's error.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from flowlift.proxy.tools.outcome import ToolOutcome


def _size(data: str) -> str:
    try:
        return f"{len(base64.b64decode(data, validate=True))} bytes"
    except (binascii.Error, ValueError):
        return f"{len(data)} base64 characters"


def block_text(block: Any) -> str:
    """One content block as text (see the module doc)."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return str(block.text)
    if kind in ("image", "audio"):
        return f"[{kind} content: {block.mime_type}, {_size(block.data)}]"
    if kind == "resource_link":
        mime = f", {block.mime_type}" if block.mime_type else ""
        return f"[resource link: {block.uri} ({block.name}{mime})]"
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        if isinstance(text, str):
            return text
        mime = f", {resource.mime_type}" if resource.mime_type else ""
        return f"[resource: {resource.uri}{mime}, {_size(resource.blob)}]"
    return f"[{kind} content]"


def outcome_of(result: Any, tool: str) -> ToolOutcome:
    """``result`` (a ``CallToolResult``) as a :class:`ToolOutcome`: its content's text,
    or its ``structuredContent`` when it has no content."""
    structured = getattr(result, "structured_content", None)
    if not result.content and structured is not None:
        if result.is_error:
            return ToolOutcome(error=json.dumps(structured, ensure_ascii=False))
        return ToolOutcome(structured)
    text = "\n".join(block_text(block) for block in result.content)
    if result.is_error:
        return ToolOutcome(error=text or f"tool {tool!r} reported an error")
    return ToolOutcome(text)
