"""``python -m flowlift.cli``: the ``flowlift`` command (:func:`flowlift.cli.main`), exit
code included."""

import sys

from flowlift.cli import main

if __name__ == "__main__":
    sys.exit(main())
