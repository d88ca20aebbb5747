"""Which Python modules define a graph's custom ops: what a fresh process imports before restoring it.

A fresh process only knows ``torch.ops.<ns>.<op>`` once the module that
registers it has been imported, so a snapshot records those modules
(``op_modules``) and restore imports them first, each still under the
allow-list (``targets``).
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["op_modules"]

_BUILTIN_OP_NAMESPACES = frozenset(
    {
        "aten",
        "prims",
        "prim",
        "higher_order",
        "_c10d_functional",
        "c10d_functional",
        "_c10d_functional_autograd",
        "quantized",
        "rngprims",
        "inductor",
    }
)


def op_modules(graph: torch.fx.Graph) -> list[str]:
    """Python modules that define the graph's custom ops.

    A fresh process only knows ``torch.ops.<ns>.<op>`` once that module has been
    imported, so restore imports these first (each still under the allow-list).
    An op made with ``torch.library.custom_op`` names its function; one defined
    through ``torch.library.Library`` is known by the module of its fake kernel.
    """
    from torch._library.custom_ops import OPDEFS
    from torch._library.simple_registry import singleton

    mods: list[str] = []
    seen: set[str] = set()
    for n in graph.nodes:
        t = n.target
        if (
            n.op == "call_function"
            and isinstance(t, torch._ops.OpOverload)
            and t.namespace not in _BUILTIN_OP_NAMESPACES
        ):
            qualname = f"{t.namespace}::{t._opname}"
            if qualname in seen:
                continue
            seen.add(qualname)
            opdef = OPDEFS.get(qualname)
            mod = getattr(getattr(opdef, "_init_fn", None), "__module__", None)
            if mod is None:
                fake = singleton.find(qualname).fake_impl.kernel
                mod = _module_of_source(getattr(fake, "source", None))
            if isinstance(mod, str) and mod not in mods and mod != "__main__":
                mods.append(mod)
    return mods


def _module_of_source(source: object) -> str | None:
    """The imported module whose file is ``source`` (torch's ``"<file>:<line>"`` of a registration)."""
    if not isinstance(source, str) or ":" not in source:
        return None
    path = os.path.realpath(source.rsplit(":", 1)[0])
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and os.path.realpath(file) == path:
            return name
    return None
