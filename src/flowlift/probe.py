"""``python -m flowlift.probe [healthz|readyz]``: a health check for containers.

Exit 0 when the proxy answers 200, else 1 with one line on stderr saying why (the
``reason`` of ``/readyz``, a refused connection...). For Docker's ``HEALTHCHECK`` and for
Kubernetes exec probes of a sidecar bound to 127.0.0.1 (an ``httpGet`` probe connects to
the pod's IP, which a proxy bound to loopback does not answer). Standard library only,
so a probe costs one small Python start and none of the proxy's imports.

Options: ``--url`` (default ``http://127.0.0.1:$FLOWLIFT_PORT`` or port 8470),
``--timeout-s`` (default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request


def check(url: str, timeout_s: float) -> str | None:
    """None when ``url`` answers 200; otherwise why not, in one line."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"{}")
        except ValueError:
            body = {}
        return f"HTTP {exc.code}: {body.get('reason') or body.get('error') or exc.reason}"
    except (urllib.error.URLError, OSError) as exc:
        return f"no answer from {url}: {getattr(exc, 'reason', exc)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flowlift.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("healthz", "readyz"), nargs="?", default="healthz")
    parser.add_argument("--url", default=None, help="the proxy's base URL")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    base = args.url or f"http://127.0.0.1:{os.environ.get('FLOWLIFT_PORT', '8470')}"
    problem = check(f"{base.rstrip('/')}/{args.what}", args.timeout_s)
    if problem is not None:
        print(f"flowlift probe {args.what}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
