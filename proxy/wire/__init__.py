"""The OpenAI wire format as pure code, the bottom of the proxy: chunk parsing
(:mod:`.chunks`), SSE bytes (:mod:`.sse_bytes`), the chat tool-call codec
(:mod:`.tool_calls`) and its output decoder (:mod:`.tool_output`), tool calls whose JSON
is complete while a turn streams (:mod:`.early_calls`), one chat message as text
(:mod:`.messages`). No I/O and no import of any other part of the proxy."""
