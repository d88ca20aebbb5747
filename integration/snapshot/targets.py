"""Qualified names for callables and classes, resolved only under a positive allow-list.

A snapshot names every node target, module class and hook callable by its
qualified name (``torch.ops.aten.add.Tensor``, ``operator.getitem``,
``torch.nn.modules.linear.Linear``).  A store may be written by other users
and hosts, so restoring must never turn a name chosen by whoever wrote the
payload into code that runs.  "Anything public under ``torch.``" is not an
allow-list: torch ships Python functions that execute source text
(``torch.fx.graph_module._exec_with_source``) or run shell commands
(``torch.utils.collect_env.run``).  A name is accepted only when the object it
resolves to is one of (docs/snapshots.md, "The allow-list"):

* an operator overload, packet or higher-order operator (``torch.ops.*``);
* one of torch's builtin (C) tensor functions: the homes in
  :data:`TORCH_C_HOMES` (``torch.add``, ``torch._C._nn.linear``, tensor
  methods), less :data:`DENIED_TORCH_BUILTINS` (``from_file`` maps files);
* a reviewed Python-level function in :data:`REVIEWED_FUNCTIONS` (what
  exported and FX-traced graphs contain, derived from the graphs of every
  architecture the tests export);
* a reviewed class: a module class defined in ``torch.nn.modules`` or a
  GraphModule class, an FX tracer class, or a value type in
  :data:`REVIEWED_CLASSES`;
* a function of ``operator``/``math`` (less attribute getters and callers) or
  a side-effect-free builtin in :data:`SAFE_BUILTINS`;
* one of the project's own modules (importing one registers custom ops) or a
  project object marked with :func:`snapshot_safe`;
* anything under a prefix the user registered with :func:`allow_prefix` or
  passes per call.

The check is on the object's *own* identity (where it is defined), so a
re-export such as ``torch.os.system`` (really ``posix.system``) is refused
whatever name reached it.  Modules are imported only when their own name is
allowed, no path component may be a dunder, and resolution never calls the
object it finds.
"""

from __future__ import annotations

import builtins
import importlib
import logging
import sys
import threading
import types
from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch

from adstore.integration.errors import UntrustedTarget
from adstore.integration.snapshot.reviewed import (
    C_HOME_OBJECTS,
    DENIED_OPERATOR,
    DENIED_TORCH_BUILTINS,
    REVIEWED_CLASSES,
    REVIEWED_FUNCTIONS,
    SAFE_BUILTINS,
    TORCH_C_HOMES,
    UNSAFE_ROOTS,
)

__all__ = [
    "DENIED_TORCH_BUILTINS",
    "REVIEWED_CLASSES",
    "REVIEWED_FUNCTIONS",
    "SAFE_BUILTINS",
    "TORCH_C_HOMES",
    "allow_prefix",
    "allowed_prefixes",
    "check_prefix",
    "is_allowed",
    "qualname_of",
    "resolve_target",
    "snapshot_safe",
]

logger = logging.getLogger(__name__)

#: Modules whose module classes (``torch.nn.Module`` subclasses) a snapshot may rebuild.
_MODULE_CLASS_HOMES: tuple[str, ...] = ("torch.nn.modules.", "torch.fx.graph_module", "torch.export.")
#: Modules whose FX tracer classes a GraphModule may record as its ``_tracer_cls``.
_TRACER_HOMES: tuple[str, ...] = ("torch.fx.",)

#: Name prefixes a qualified name must start with before anything is imported or walked.
_NAME_PREFIXES: tuple[str, ...] = ("torch.", "operator.", "_operator.", "math.", "builtins.", "adstore.integration.")
#: The project's own modules: importing one is safe (it registers custom ops at most).
_PROJECT_PREFIX = "adstore.integration."
_SAFE_MARK = "_adstore_snapshot_safe"

# Canonical module names that are aliases of an allowed public module.
_MODULE_ALIASES = {"_operator": "operator"}

_user_prefixes: list[str] = []
_lock = threading.Lock()
_cache: dict[tuple[str, tuple[str, ...]], object] = {}

_T = TypeVar("_T")


def snapshot_safe(obj: _T) -> _T:
    """Mark one of the project's own functions or classes as nameable by snapshots.

    Only objects defined under ``adstore.integration`` honour the mark, and a
    class's mark is not inherited by subclasses defined elsewhere.
    """
    setattr(obj, _SAFE_MARK, True)
    return obj


def check_prefix(prefix: str) -> str:
    """Validate a user allow-list prefix.

    Modules that grant code execution outright are refused, and so are
    ``torch`` and ``operator`` as a whole: widening those is what the positive
    list exists to prevent (name a package of your own, e.g. ``"mypkg."``).
    """
    if not isinstance(prefix, str) or not prefix.strip(".") or "__" in prefix or " " in prefix:
        raise ValueError(f"invalid allow-list prefix {prefix!r}")
    if prefix.split(".")[0] in UNSAFE_ROOTS:
        raise ValueError(f"refusing to allow-list {prefix!r}: it grants arbitrary code execution")
    return prefix


def allow_prefix(prefix: str) -> None:
    """Trust ``prefix`` (e.g. ``"mypkg."``) process-wide for targets, classes and hooks.

    A prefix without a trailing dot also matches the bare module name (``"mypkg"``
    allows ``mypkg`` and ``mypkg.x`` but not ``mypkgevil``).
    """
    check_prefix(prefix)
    with _lock:
        if prefix not in _user_prefixes:
            _user_prefixes.append(prefix)
            _cache.clear()
    logger.debug("allow-listed snapshot prefix %s", prefix)


def allowed_prefixes(extra_prefixes: Iterable[str] = ()) -> tuple[str, ...]:
    """The user prefixes in force: registered with :func:`allow_prefix`, and ``extra_prefixes``."""
    return tuple(_user_prefixes) + tuple(extra_prefixes)


def _prefix_match(name: str, prefix: str) -> bool:
    if prefix.endswith("."):
        return name.startswith(prefix) or name == prefix[:-1]
    return name == prefix or name.startswith(prefix + ".")


def _user_allowed(name: str, extra: Iterable[str]) -> bool:
    return any(_prefix_match(name, p) for p in allowed_prefixes(extra))


def is_allowed(qualname: str, extra_prefixes: Iterable[str] = ()) -> bool:
    """Whether ``qualname`` may be looked up at all (a name check; no import happens).

    Passing this is necessary, not sufficient: :func:`resolve_target` then checks
    the identity of the object the name resolves to.
    """
    if not isinstance(qualname, str) or not qualname:
        return False
    if qualname.startswith("builtins."):
        return qualname[len("builtins.") :] in SAFE_BUILTINS
    if qualname.split(".", 1)[0] in ("operator", "_operator") and qualname.rsplit(".", 1)[-1] in DENIED_OPERATOR:
        return False
    return qualname.startswith(_NAME_PREFIXES) or _user_allowed(qualname, extra_prefixes)


def _home_of_builtin(obj: object) -> str | None:
    """Where a C function or method descriptor lives (its module, or the class that holds it)."""
    holder = getattr(obj, "__self__", None)
    if holder is None or isinstance(holder, types.ModuleType):
        holder = getattr(obj, "__objclass__", holder)
    if isinstance(holder, types.ModuleType):
        return holder.__name__
    if isinstance(holder, type):
        return f"{holder.__module__}.{holder.__qualname__}"
    mod = getattr(obj, "__module__", None)
    return mod if isinstance(mod, str) else None


def _is_torch_builtin(obj: object, name: str) -> bool:
    """Whether ``obj`` *is* one of torch's C tensor functions (by identity, not by name)."""
    return any(getattr(home, name, None) is obj for home in C_HOME_OBJECTS)


def _defined_name(obj: object) -> str | None:
    mod = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if not isinstance(mod, str) or not isinstance(name, str):
        return None
    return f"{_MODULE_ALIASES.get(mod, mod)}.{name}"


def _is_reviewed(obj: object) -> bool:
    """The positive list: is this object, judged by where it is defined, safe to name?"""
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return True
    if obj is Ellipsis or obj is NotImplemented:
        return True
    if isinstance(obj, types.ModuleType):
        return obj.__name__.startswith(_PROJECT_PREFIX)
    if isinstance(obj, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)):
        name = getattr(obj, "__name__", "")
        if _is_torch_builtin(obj, name):
            return name not in DENIED_TORCH_BUILTINS
        home = _home_of_builtin(obj)
        if home in ("_operator", "operator"):
            return name not in DENIED_OPERATOR
        if home == "math":
            return True
        if home == "builtins":
            return name in SAFE_BUILTINS
        return f"{home}.{name}" in REVIEWED_FUNCTIONS
    defined = _defined_name(obj)
    if defined is None:
        return False
    if defined.startswith(_PROJECT_PREFIX) and _SAFE_MARK in getattr(obj, "__dict__", {}):
        return True
    if isinstance(obj, type):
        if obj.__module__ == "builtins":
            return obj.__name__ in SAFE_BUILTINS
        if defined in REVIEWED_CLASSES or obj.__module__ == "torch.return_types":
            return True
        if issubclass(obj, torch.nn.Module):
            return defined.startswith(_MODULE_CLASS_HOMES)
        if issubclass(obj, torch.fx.Tracer):
            return defined.startswith(_TRACER_HOMES)
        return False
    return isinstance(obj, types.FunctionType) and defined in REVIEWED_FUNCTIONS


def _check_identity(qualname: str, obj: object, extra: Sequence[str]) -> None:
    if _is_reviewed(obj):
        return
    # User-registered prefixes are judged by where the object really lives, too.
    owner = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    if isinstance(owner, str) and _user_allowed(_MODULE_ALIASES.get(owner, owner), extra):
        return
    raise UntrustedTarget(qualname)


def _import_allowed(modname: str, extra: Sequence[str]) -> types.ModuleType | None:
    """An already-imported module, or one whose own name the project or the user trusts."""
    mod = sys.modules.get(modname)
    if mod is not None:
        return mod
    if not (modname.startswith(_PROJECT_PREFIX) or _user_allowed(modname, extra)):
        return None
    try:
        return importlib.import_module(modname)
    except ImportError:
        return None


def resolve_target(qualname: str, extra_prefixes: Sequence[str] = ()) -> object:
    """Return the object named ``qualname`` if, and only if, the allow-list permits it.

    Raises :class:`~adstore.integration.errors.UntrustedTarget` for anything outside
    the allow-list, a denied name, a dunder path, a name that does not resolve, or
    an object whose real home is elsewhere.  Nothing found is ever called.
    """
    extra = tuple(extra_prefixes)
    key = (qualname, extra)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    if not isinstance(qualname, str) or not is_allowed(qualname, extra):
        raise UntrustedTarget(str(qualname))
    parts = qualname.split(".")
    if any(not p for p in parts):
        raise UntrustedTarget(qualname)
    if parts[0] == "builtins":
        obj = getattr(builtins, parts[1], None) if len(parts) == 2 else None
        if obj is None:
            raise UntrustedTarget(qualname)
        _cache[key] = obj
        return obj
    # Longest importable module prefix, importing only allowed module names.
    obj: object = None
    index = 0
    for i in range(len(parts), 0, -1):
        modname = ".".join(parts[:i])
        if modname in sys.modules or i == 1:
            obj = _import_allowed(modname, extra)
            if obj is not None:
                index = i
                break
    if obj is None:
        for i in range(len(parts), 0, -1):
            obj = _import_allowed(".".join(parts[:i]), extra)
            if obj is not None:
                index = i
                break
    if obj is None:
        raise UntrustedTarget(qualname)
    for part in parts[index:]:
        in_ops = isinstance(obj, (torch._ops._OpNamespace, torch._ops.OpOverloadPacket)) or type(obj).__name__ in (
            "_Ops",
            "_HigherOrderNamespace",
            "_PyOpNamespace",
        )
        if not (in_ops or isinstance(obj, (types.ModuleType, type))):
            raise UntrustedTarget(qualname)
        if part.startswith("__") and part.endswith("__") and not in_ops:
            raise UntrustedTarget(qualname)
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            # a submodule that is not imported yet (allowed names only)
            sub = _import_allowed(f"{obj.__name__}.{part}", extra) if isinstance(obj, types.ModuleType) else None
            if sub is None:
                raise UntrustedTarget(qualname) from None
            obj = sub
    _check_identity(qualname, obj, extra)
    _cache[key] = obj
    return obj


def qualname_of(obj: object) -> str | None:
    """A qualified name under which :func:`resolve_target` (allow-list aside) finds ``obj`` again.

    ``None`` when the object has no stable importable name (closures, lambdas,
    ``<locals>`` functions, instances).  The round trip is verified here, so a
    name that points to a different object is never written.
    """
    if isinstance(obj, torch._ops.OpOverload):
        name = f"torch.ops.{obj.namespace}.{obj._opname}.{obj._overloadname}"
    elif isinstance(obj, torch._ops.OpOverloadPacket):
        ns = obj._qualified_op_name.split("::")[0]
        name = f"torch.ops.{ns}.{obj._qualified_op_name.split('::')[1]}"
    elif isinstance(obj, torch._ops.HigherOrderOperator):
        name = f"torch.ops.higher_order.{obj.__name__}"
    else:
        qn = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        mod = getattr(obj, "__module__", None)
        if not isinstance(qn, str) or "<" in qn:
            return None
        if mod is None:
            short = getattr(obj, "__name__", qn)
            candidates = [
                f"torch.{short}",
                f"torch._C._nn.{short}",
                f"torch.nn.functional.{short}",
                f"torch.Tensor.{short}",
                f"torch.special.{short}",
                f"torch.linalg.{short}",
            ]
        else:
            candidates = [f"{_MODULE_ALIASES.get(mod, mod)}.{qn}"]
            short = getattr(obj, "__name__", qn)
            if short != qn:
                candidates.append(f"{_MODULE_ALIASES.get(mod, mod)}.{short}")
            if mod == "_operator":
                candidates.insert(0, f"operator.{qn}")
        for cand in candidates:
            if _lookup_unchecked(cand) is obj:
                return cand
        return None
    return name if _lookup_unchecked(name) is obj else None


def _lookup_unchecked(qualname: str) -> object:
    """Save-side lookup among already-imported modules (no allow-list, no import)."""
    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is not None:
            obj: object = mod
            try:
                for part in parts[i:]:
                    obj = getattr(obj, part)
            except (AttributeError, RuntimeError):
                return None
            return obj
    return None
