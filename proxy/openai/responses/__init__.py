"""The Responses API (``/v1/responses``) served by the proxy itself, statefully, on every
backend: translated to chat completions, the conversation kept in the run store."""
