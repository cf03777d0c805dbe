"""Upstream providers over HTTP: the provider (client, key, headers), aiohttp/httpx and
their errors (:mod:`.http`), health (in-flight counts, cool-down), attempts (retries,
fallbacks), chat streams from upstreams (:mod:`.engine`), drop-in requests forwarded
(:mod:`.forward`)."""
