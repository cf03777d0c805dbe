"""The client side of the proxy's API keys (``[server] api_keys_env`` in its config).

The SDK (``workflow(..., api_key=...)``) and the CLI (``--api-key``) send the key as
``Authorization: Bearer <key>`` on every request to the proxy; both default to
``$FLOWLIFT_API_KEY``. The key is never logged, put in a trace or span, or quoted in
an error.
"""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "FLOWLIFT_API_KEY"
HINT = f"set {API_KEY_ENV} or pass api_key= to workflow(...)"
CLI_HINT = f"pass --api-key or set {API_KEY_ENV}"


def default_api_key() -> str | None:
    """``$FLOWLIFT_API_KEY``, or None when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}``, or no header without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    """``--api-key`` on a CLI command that talks to a proxy (read with :func:`cli_key`;
    the environment is read at use, so ``--help`` never prints the key)."""
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help=f"the proxy's API key, sent as `Authorization: Bearer` "
                             f"(default ${API_KEY_ENV})")


def cli_key(args: argparse.Namespace) -> str | None:
    """The key a CLI command sends: ``--api-key``, else ``$FLOWLIFT_API_KEY``."""
    return getattr(args, "api_key", None) or default_api_key()
