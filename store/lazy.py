"""Lazy exports for a package's ``__init__``: a name's module is imported when the name is first used.

A process that restarts from the cache opens a store and reads one entry; it
never plans an eviction, verifies, rebuilds an index or talks to a remote.
Importing those modules (and ``psutil``, ``http.client``, ``ssl``) with the
package cost a warm restart a quarter of a second, so a package lists its
public names with the module each comes from, and :func:`exports` resolves
them on first access (PEP 562).  Type checkers read the same names from an
``if TYPE_CHECKING:`` block.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["exports"]


def exports(
    package: str, table: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps each public name to its module.

    A name is imported from its module (relative to ``package``) on first
    access and kept in ``namespace`` (the package's globals), so later
    accesses cost a dict lookup.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__
