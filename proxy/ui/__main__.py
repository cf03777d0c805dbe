"""``python -m flowlift.proxy.ui DIR``: write the compile page, with the compiler that runs
in the browser, as a static folder (:func:`flowlift.proxy.ui.offline.build_static`)."""

from __future__ import annotations

import sys
from pathlib import Path

from flowlift.errors import ConfigError
from flowlift.proxy.ui.offline import build_static
from flowlift.proxy.ui.pages import static_compile_page


def main(argv: list[str] | None = None) -> int:
    """``python -m flowlift.proxy.ui DIR``: build the static compile page."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m flowlift.proxy.ui DIR", file=sys.stderr)
        return 2
    try:
        index = build_static(Path(args[0]), static_compile_page())
    except ConfigError as exc:
        print(f"flowlift: {exc.message}", file=sys.stderr)
        return 1
    print(f"flowlift: the compile page is in {index.parent}; serve it with "
          f"`python -m http.server -d {index.parent}` and open http://localhost:8000/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
