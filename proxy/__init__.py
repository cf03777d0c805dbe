"""The flowlift proxy: an aiohttp sidecar serving the workflow API and the OpenAI API."""

from flowlift.proxy.app import create_app
from flowlift.proxy.config import ProxyConfig
from flowlift.proxy.state import STATE, ProxyState

__all__ = ["STATE", "ProxyConfig", "ProxyState", "create_app"]
