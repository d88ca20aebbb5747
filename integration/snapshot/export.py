"""What ``torch.export(...).module()`` adds to a GraphModule, and bound methods, recognised and recreated.

An exported module carries pieces that are not plain structure: forward
pre/post hooks that are lambdas, ``train``/``eval`` bound to local functions, and
a ``_guards_fn`` submodule whose body is ``exec``'d text.  None of them can be
serialised safely, and all of them are standard, so the snapshot records only
*that* they were there and restore builds equivalents from code in this module.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from adstore.integration.errors import CorruptSnapshot, UnsupportedModule, UntrustedTarget
from adstore.integration.snapshot.names import identifier
from adstore.integration.snapshot.targets import qualname_of, resolve_target

__all__ = [
    "STATEFUL_GM",
    "LazyGraphModule",
    "RestoredExportModule",
    "RestoredGuards",
    "bind_method",
    "check_export_inputs",
    "encode_bound_method",
    "export_forward_hooks",
]

STATEFUL_GM = "torch.export._unlift._StatefulGraphModule"

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
except ImportError:  # pragma: no cover - a torch without it restores eagerly (same module, old cost)
    LazyGraphModule = torch.fx.GraphModule  # type: ignore[misc]
"""The class restored GraphModules have: it generates its Python code when first needed.

A restored graph is often never run as Python: on an engine-cache hit the
compile stage replaces it with the engine, and a transform that edits it
(``fuse_linears``) would generate its code once more.  Generating the code of
a 24-layer Llama graph costs about 0.07 s each time, a sixth of a warm
restart.  torch's ``_LazyGraphModule`` (Inductor's pattern passes use it for
the same reason) turns ``recompile`` into a mark and generates the code on
the first call, ``.code`` or pickle.  It is private API; without it restores
are eager GraphModules, which behave the same.
"""


class RestoredExportModule(LazyGraphModule):
    """Stands in for export's ``_StatefulGraphModule`` after a restore.

    Importing ``torch.export._unlift`` (where that class lives) imports
    ``torch._dynamo``, about 0.8 s of a restart that only runs the model.
    This class carries the same state (``range_constraints``,
    ``validate_inputs``) and gets the same input check
    (:func:`check_export_inputs`); a snapshot of it records export's class
    name again, so both restore the same way.  Nothing in torch tests for
    ``_StatefulGraphModule`` outside the module that defines it.
    """

    def __init__(self, root: torch.nn.Module, graph: torch.fx.Graph, range_constraints: Any = None) -> None:
        super().__init__(root, graph)
        self.range_constraints = range_constraints or []
        self.validate_inputs = True


def check_export_inputs(self: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Export's forward pre-hook (``_check_input_constraints_pre_hook``), without importing dynamo.

    The inputs must flatten to the exported input spec; without a
    ``_guards_fn`` in the graph, the placeholders' sizes and symbol ranges are
    checked too, by torch's own function.  A spec that differs by ``==`` is
    handed to export's own matcher (it normalises a few container types and
    raises export's error), so the verdict is always export's.
    """
    if not self.validate_inputs:
        return
    from torch._export.utils import _check_input_constraints_for_graph
    from torch.export._tree_utils import reorder_kwargs

    if "_in_spec" not in self.__dict__ and isinstance(self, LazyGraphModule):
        self.real_recompile()  # a restored module's code, deferred until now, sets the spec
    in_spec = self._in_spec
    flat, received = pytree.tree_flatten_with_path((args, reorder_kwargs(kwargs, in_spec)))
    if received != in_spec:
        from torch.export._unlift import _check_inputs_match

        flat = _check_inputs_match(args, kwargs, in_spec)
    if hasattr(self, "_guards_fn") or torch.compiler.is_dynamo_compiling():
        return  # the graph calls its guards itself; under compilation export skips the check as well
    _check_input_constraints_for_graph(self.graph.find_nodes(op="placeholder"), flat, self.range_constraints)


def _is_stateful(module: torch.nn.Module) -> bool:
    if isinstance(module, RestoredExportModule):
        return True
    unlift = sys.modules.get("torch.export._unlift")  # nothing can be one if export never ran here
    return unlift is not None and isinstance(module, unlift._StatefulGraphModule)


def _export_train(self: torch.nn.Module, mode: bool = True) -> Any:
    """Stands in for the ``train`` that ``ExportedProgram.module()`` binds (same behaviour)."""
    raise NotImplementedError("Calling train() is not supported yet.")


def _export_eval(self: torch.nn.Module, mode: bool = True) -> Any:
    """Stands in for the ``eval`` that ``ExportedProgram.module()`` binds (same behaviour)."""
    raise NotImplementedError("Calling eval() is not supported yet.")


_EXPORT_METHODS = {
    "ExportedProgram.module.<locals>._train": "export_train",
    "ExportedProgram.module.<locals>._eval": "export_eval",
    "_export_train": "export_train",
    "_export_eval": "export_eval",
}


class RestoredGuards(torch.nn.Module):
    """Replaces export's ``_guards_fn`` (whose body is ``exec``'d text) after a restore.

    It checks the same input constraints export checks without a guards module:
    ranks, static sizes and symbolic ranges of the placeholders, using torch's own
    ``_check_input_constraints_for_graph`` over the restored ``meta["val"]``.
    """

    _is_impure = True

    def bind(self, gm: torch.fx.GraphModule) -> None:
        object.__setattr__(self, "_gm_ref", weakref.ref(gm))

    def forward(self, *args: Any) -> None:
        from torch._export.utils import _check_input_constraints_for_graph

        ref = self.__dict__.get("_gm_ref")
        gm = ref() if ref is not None else None
        if gm is None:
            return None
        placeholders = gm.graph.find_nodes(op="placeholder")
        _check_input_constraints_for_graph(
            placeholders, _with_paths(gm, args), getattr(gm, "range_constraints", {}) or {}
        )
        return None


def _with_paths(gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """The placeholders' values with export's key paths (``*args[0]``, ``y``), which torch's error names.

    Paths of the form ``(args or kwargs, key, ...)``, from the graph's input
    spec: a 1-element path made torch's message itself fail (``IndexError``)
    where it should say which input was not the exported value.
    """
    spec = getattr(gm, "_in_spec", None)
    if spec is not None:
        try:
            flat = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(args), spec))[0]
        except (TypeError, ValueError, IndexError):
            flat = []
        if len(flat) == len(args):
            return flat
    return [((pytree.SequenceKey(0), pytree.SequenceKey(i)), a) for i, a in enumerate(args)]


def _is_export_hook_lambda(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__module__", "") != "torch.export._unlift":
        return False
    if "_create_stateful_graph_module" not in getattr(fn, "__qualname__", ""):
        return False
    cells = [c.cell_contents for c in (fn.__closure__ or ())]
    return all(isinstance(c, (set, frozenset, list, tuple)) and not c for c in cells)


def export_forward_hooks(module: torch.nn.Module) -> bool | None:
    """True if ``module``'s forward hooks are exactly export's standard ones (recreated on load),
    None if it has no forward hooks, False otherwise (the save must skip)."""
    pre = list(module._forward_pre_hooks.values())
    post = list(module._forward_hooks.values())
    if not pre and not post:
        return None
    if not isinstance(module, torch.fx.GraphModule) or not _is_stateful(module):
        return False
    unlift = sys.modules.get("torch.export._unlift")
    checks = {check_export_inputs} | ({unlift._check_input_constraints_pre_hook} if unlift is not None else set())
    for h in pre:
        if h not in checks and not _is_export_hook_lambda(h):
            return False
    return all(_is_export_hook_lambda(h) for h in post)


def encode_bound_method(gm: torch.nn.Module, name: str, value: types.MethodType, path: str) -> list[str]:
    """Spec of an instance-bound method: ``[name, kind, qualname]``."""
    if value.__self__ is not gm:
        raise UnsupportedModule(f"{path or '<root>'}: attribute {name!r} is a method bound to another object")
    func = value.__func__
    kind = _EXPORT_METHODS.get(getattr(func, "__qualname__", ""))
    if kind and getattr(func, "__module__", "") in ("torch.export.exported_program", _export_train.__module__):
        return [name, kind, ""]
    q = qualname_of(func)
    if q is None:
        raise UnsupportedModule(f"{path or '<root>'}: bound method {name!r} ({func!r}) is not importable")
    return [name, "func", q]


def bind_method(gm: torch.nn.Module, name: Any, kind: Any, q: Any, extra: Sequence[str]) -> None:
    """Re-bind one method from its :func:`encode_bound_method` spec (a function under the allow-list)."""
    identifier(name, "method name")
    if kind == "export_train":
        fn: Any = _export_train
    elif kind == "export_eval":
        fn = _export_eval
    elif kind == "func":
        fn = resolve_target(q, extra)
        if not isinstance(fn, types.FunctionType):
            raise UntrustedTarget(q)
    else:
        raise CorruptSnapshot(f"unknown bound-method kind {kind!r}")
    setattr(gm, name, types.MethodType(fn, gm))
