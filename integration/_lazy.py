"""Lazy package exports: a name is imported on first use, not when its package is.

``import adstore.integration`` must stay cheap (no torch) so that tools which
only need the store start fast; the subpackages use the same mechanism so that
importing one never drags in the others (or an import cycle between them).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module ``__getattr__`` and ``__dir__`` for ``package``.

    ``exports`` maps a module (relative to ``adstore.integration``) to the
    names it provides.  A value is cached in the package's namespace on first
    access, so later lookups (and ``monkeypatch.setattr`` in tests) see an
    ordinary attribute.
    """
    where = {name: f"adstore.integration.{module}" for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
