"""The OpenAI-compatible API: the routes, and one folder per endpoint the embedded engine
serves (``chat_completion/``, ``completion/``) in the layout of vLLM's
``entrypoints/openai/<endpoint>/``; ``generation`` runs an OpenAI request's generations
on the embedded engine.
"""
