"""``POST /v1/completions`` (legacy text completions) on the embedded engine.
"""
