"""``python -m adstore.daemon …`` is the ``adstore`` command (e.g. ``python -m adstore.daemon daemon --config …``)."""

import sys

from adstore.daemon.cli import main

if __name__ == "__main__":
    sys.exit(main())
