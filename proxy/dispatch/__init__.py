"""Where a model request goes: the backends (embedded engines and upstream providers), per-
backend priority slots, routing among replicas and fallbacks, attempts with retries,
upstream clients and health, and forwarding of drop-in requests.
"""
