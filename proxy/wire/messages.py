"""One OpenAI chat message as plain ``(role, text)``: the graph's view of a message,
the same for a request's messages and a response's (so that a later request quoting it,
an agent loop, matches verbatim). Pure code, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

Role = Literal["system", "user", "assistant"]
_ROLES: dict[str, Role] = {"system": "system", "developer": "system",
                           "assistant": "assistant"}


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Mapping):
            value = part.get("text", part.get("refusal"))
            out.append(value if isinstance(value, str) else f"[{part.get('type')}]")
    return "".join(out)


def render_message(message: Mapping[str, Any]) -> tuple[Role, str]:
    """One OpenAI chat message as ``(role, text)``, the same way for every call.

    Roles map onto the graph's: ``developer`` -> ``system``, ``tool``/``function`` ->
    ``user``. Text parts are joined as they are; other parts (images, audio, files)
    become ``[image_url]``-style markers; tool calls are appended, one per line, as
    ``[tool call NAME: ARGUMENTS]``. Render a response's message with this too, so
    that a later request quoting it (an agent loop) matches verbatim.
    """
    role = _ROLES.get(str(message.get("role")), "user")
    text = _content_text(message.get("content"))
    raw = [c.get("function") for c in message.get("tool_calls") or []
           if isinstance(c, Mapping)]
    raw.append(message.get("function_call"))  # the legacy single call
    lines = [f"[tool call {c.get('name')}: {c.get('arguments')}]" for c in raw
             if isinstance(c, Mapping)]
    return role, "\n".join([text, *lines] if text else lines)
