"""``python -m adstore …`` is the ``adstore`` command, for users who reach for ``python -m`` first.

The ``adstore`` namespace package maps to this folder (pyproject.toml), which
holds this file only: the code lives in ``adstore.store``, ``adstore.integration``
and ``adstore.daemon``.
"""

import sys

from adstore.daemon.cli import main

if __name__ == "__main__":
    sys.exit(main())
