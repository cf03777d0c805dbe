"""``POST /v1/chat/completions`` on the embedded engine: request shape and serving, tool
calling built on structured outputs.
"""
