"""The flowlift proxy: an aiohttp sidecar serving the workflow API and the OpenAI API."""

from flowlift.proxy.app import ProxyConfig, create_app

__all__ = ["ProxyConfig", "create_app"]
