"""The stdlib_docs example: documentation triage over the standard library's docstrings."""
