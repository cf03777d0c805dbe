"""Agent sessions (``X-Flowlift-Session``): the bounded table of what each session's turns
reused, and ``GET /v1/sessions/{id}``.
"""
