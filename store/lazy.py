"""Lazy package exports: a name's module is imported when the name is first used (PEP 562).

A process that restarts from the cache opens a store and reads one entry; it
never plans an eviction, verifies, rebuilds an index or talks to a remote.
Importing those modules (and ``psutil``, ``http.client``, ``ssl``) with the
package cost a warm restart a quarter of a second, so a package lists its
public names by the module each comes from, and :func:`lazy_exports`
resolves them on first access.  Type checkers read the same names from an
``if TYPE_CHECKING:`` block.  The integration's packages use the same
function (exported by ``adstore.store``), so ``import adstore.integration``
imports no torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]], *, base: str | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module ``__getattr__`` and ``__dir__`` for ``package``.

    ``exports`` maps a module to the names it provides: relative to ``base``
    when given (``"inductor.plug"`` under ``"adstore.integration"``), else to
    ``package`` itself (``".store"``).  A value is kept in the package's
    namespace on first access, so later lookups (and ``monkeypatch.setattr``
    in tests) see an ordinary attribute.
    """
    where = {
        name: f"{base}.{module}" if base else importlib.util.resolve_name(module, package)
        for module, names in exports.items()
        for name in names
    }

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
