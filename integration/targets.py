"""Qualified names for callables and classes, resolved only under an allow-list.

A snapshot names every node target, module class and hook callable by its
qualified name (``torch.ops.aten.add.Tensor``, ``operator.getitem``,
``torch.nn.modules.linear.Linear``).  Restoring must never turn a name chosen by
whoever wrote the payload into code that runs, so resolution is deliberately
narrow:

* the name must start with an allowed prefix (the built-in ones below, the
  process-wide registry filled by :func:`allow_prefix`, and per-call extras);
* a small deny-list inside ``torch`` (hub, cpp_extension, package, loaders)
  is refused even though it starts with ``torch.``;
* a module is only imported when its own name is allowed, and no path
  component may be a dunder (``torch.__builtins__``);
* the resolved object's *own* identity (``__module__`` of a function or class,
  ``__name__`` of a module) must be allowed too, so re-exports such as
  ``torch.os.system`` resolve to ``posix.system`` and are refused;
* from ``builtins`` only an explicit side-effect-free subset is allowed.

Resolution never calls the object it finds.
"""

from __future__ import annotations

import builtins
import importlib
import logging
import sys
import threading
import types
from typing import Iterable, Sequence

import torch

from adstore.integration.errors import UntrustedTarget

__all__ = [
    "BUILTIN_PREFIXES",
    "SAFE_BUILTINS",
    "allow_prefix",
    "allowed_prefixes",
    "check_prefix",
    "is_allowed",
    "qualname_of",
    "resolve_target",
]

logger = logging.getLogger(__name__)

#: Prefixes every process trusts. ``builtins`` is handled by :data:`SAFE_BUILTINS`.
BUILTIN_PREFIXES: tuple[str, ...] = ("torch.", "operator.", "_operator.", "math.", "adstore.")

#: Entry points inside ``torch`` that load or compile code from elsewhere (a name is denied
#: when it equals an entry or lies below it).
_DENIED_PREFIXES: tuple[str, ...] = (
    "torch.hub",
    "torch.utils.cpp_extension",
    "torch.package",
    "torch.serialization",
    "torch.load",
    "torch.jit.load",
    "torch.jit._serialization",
    "torch.ops.load_library",
    "torch._ops.load_library",
    "torch.export.load",
    "torch.compile",
    "torch._dynamo",
    "torch._inductor",
    # Attribute getters and callers would let a graph reach names it does not spell out.
    "operator.attrgetter",
    "operator.methodcaller",
    "operator.call",
    "_operator.attrgetter",
    "_operator.methodcaller",
    "_operator.call",
)
#: Raw name prefixes denied regardless of dots (private C bindings of the above).
_DENIED_RAW: tuple[str, ...] = ("torch._C._jit", "torch._C._import_ir", "torch._C._load_for_lite")

#: The side-effect-free builtins a graph may name (``builtins.getattr`` etc.).
SAFE_BUILTINS: frozenset[str] = frozenset(
    {
        "abs", "all", "any", "bool", "complex", "dict", "divmod", "float", "frozenset",
        "getattr", "hasattr", "int", "isinstance", "issubclass", "len", "list", "max",
        "min", "pow", "range", "reversed", "round", "set", "slice", "sorted", "str",
        "sum", "tuple", "zip", "enumerate", "map", "filter", "Ellipsis", "NotImplemented",
    }
)

# Canonical module names that are aliases of an allowed public module.
_MODULE_ALIASES = {"_operator": "operator"}

_user_prefixes: list[str] = []
_lock = threading.Lock()
_cache: dict[tuple[str, tuple[str, ...]], object] = {}


_UNSAFE_ROOTS = frozenset({"builtins", "os", "posix", "nt", "subprocess", "sys", "importlib", "pickle",
                           "marshal", "ctypes", "shutil", "runpy", "code", "codeop", "pty", "socket", ""})


def check_prefix(prefix: str) -> str:
    """Validate an allow-list prefix; modules that grant code execution outright are refused."""
    if not isinstance(prefix, str) or not prefix.strip(".") or "__" in prefix or " " in prefix:
        raise ValueError(f"invalid allow-list prefix {prefix!r}")
    if prefix.split(".")[0] in _UNSAFE_ROOTS:
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
    """The prefixes in force: built-in, registered with :func:`allow_prefix`, and ``extra_prefixes``."""
    return BUILTIN_PREFIXES + tuple(_user_prefixes) + tuple(extra_prefixes)


def _prefix_match(name: str, prefix: str) -> bool:
    if prefix.endswith("."):
        return name.startswith(prefix) or name == prefix[:-1]
    return name == prefix or name.startswith(prefix + ".")


def is_allowed(qualname: str, extra_prefixes: Iterable[str] = ()) -> bool:
    """Whether ``qualname`` is under an allowed prefix and not denied (no import happens)."""
    if not isinstance(qualname, str) or not qualname:
        return False
    if any(_prefix_match(qualname, p) for p in _DENIED_PREFIXES) or qualname.startswith(_DENIED_RAW):
        return False
    if qualname.startswith("builtins."):
        return qualname[len("builtins."):] in SAFE_BUILTINS
    return any(_prefix_match(qualname, p) for p in allowed_prefixes(extra_prefixes))


def _owner_name(obj: object) -> str | None:
    """The module an object really lives in, for the identity check."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    mod = getattr(obj, "__module__", None)
    if isinstance(mod, str):
        return _MODULE_ALIASES.get(mod, mod)
    # C functions bound to a class (torch.relu is a method of torch._C._VariableFunctionsClass)
    # and method descriptors (torch.Tensor.add) live where their class lives.
    if isinstance(obj, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)):
        holder = getattr(obj, "__self__", None) or getattr(obj, "__objclass__", None)
        if isinstance(holder, type):
            hmod = getattr(holder, "__module__", None)
            if isinstance(hmod, str) and hmod != "builtins":
                return hmod
    return None


def _check_identity(qualname: str, obj: object, extra: Sequence[str]) -> None:
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return
    if obj is Ellipsis or obj is NotImplemented:
        return
    owner = _owner_name(obj)
    if owner == "builtins":
        name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
        if name in SAFE_BUILTINS:
            return
        raise UntrustedTarget(qualname)
    if owner is None:
        raise UntrustedTarget(qualname)
    if isinstance(obj, types.ModuleType):
        if not is_allowed(owner, extra):
            raise UntrustedTarget(qualname)
        return
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "")
    if getattr(obj, "__module__", None) is None:
        name = getattr(obj, "__name__", "")
    full = f"{owner}.{name}" if name else owner
    if not (is_allowed(full, extra) or is_allowed(owner + ".", extra)):
        raise UntrustedTarget(qualname)


def _import_allowed(modname: str, extra: Sequence[str]) -> types.ModuleType | None:
    mod = sys.modules.get(modname)
    if mod is not None:
        return mod
    if not is_allowed(modname, extra) and not is_allowed(modname + ".", extra):
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
            "_Ops", "_HigherOrderNamespace", "_PyOpNamespace")
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
            candidates = [f"torch.{short}", f"torch._C._nn.{short}", f"torch.nn.functional.{short}",
                          f"torch.Tensor.{short}", f"torch.special.{short}", f"torch.linalg.{short}"]
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
