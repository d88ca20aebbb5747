"""Canonical forms of code, functions and the values code reads: what an ``aot_compile`` key holds of them.

A key must be the same in every process that runs the same code, whatever
``PYTHONHASHSEED`` says: ``repr()`` of a code object's constants is not
(``torch.nn.modules.conv._ConvNd.__init__`` holds a ``frozenset`` whose
``repr`` order follows string hashing), and neither is anything that shows
an id or an address.  So every form here is built from data only:

* :func:`code_digest`: a code object's bytecode, names, argument counts,
  flags, exception table and constants, each constant encoded exactly
  (:func:`const_bytes`: floats by their hex text, ``frozenset`` members sorted
  by their own encoding, nested tuples and code objects recursively); never
  its file name or line numbers;
* :func:`value_form`: a value code reads (a module attribute, a closure
  cell, a default, a global) as canonical JSON data: plain values by value,
  containers recursively, modules and classes by import name, builtins,
  torch's functions and operators by their qualified import name, and a
  Python function by what it runs (:func:`function_form`: its code, defaults,
  closure cells and the globals it reads, recursively).  Anything else has no
  canonical form: :class:`~adstore.integration.errors.CacheKeyError`, and the
  call is not served from the store;
* :class:`Watch`: the objects a key was built from that a program can rebind
  later (globals, function-valued attributes), checked by identity on every
  call of the same process, so a changed global is never answered from an
  artifact compiled for the old one.
"""

from __future__ import annotations

import builtins
import dis
import enum
import functools
import hashlib
import importlib
import math
import types
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from adstore.integration.errors import CacheKeyError
from adstore.integration.validity.keys import canonical, canonical_json

__all__ = [
    "Watch",
    "code_digest",
    "const_bytes",
    "function_form",
    "global_names",
    "import_name",
    "is_torch_code",
    "opaque",
    "value_form",
]

#: How deep functions reached through closures, defaults and globals are followed.
_MAX_DEPTH = 8
_PLAIN = (bool, int, float, str, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)
_MISSING = object()
#: Containers up to this size are compared by value on every call (a list can change in place); larger, by identity.
_WATCHED_ITEMS = 32


def _sized(tag: bytes, data: bytes) -> bytes:
    return tag + str(len(data)).encode() + b":" + data


def const_bytes(value: Any) -> bytes:
    """A code constant's exact, self-delimiting encoding; :class:`CacheKeyError` for a kind code never holds."""
    if value is None:
        return b"N"
    if value is Ellipsis:
        return b"E"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        return b"i" + str(value).encode() + b";"
    if isinstance(value, float):
        return b"f" + value.hex().encode() + b";"  # exact: -0.0, nan and inf included
    if isinstance(value, complex):
        return b"c" + value.real.hex().encode() + b"," + value.imag.hex().encode() + b";"
    if isinstance(value, str):
        return _sized(b"s", value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bytes):
        return _sized(b"b", value)
    if isinstance(value, tuple):
        return b"(" + b"".join(const_bytes(v) for v in value) + b")"
    if isinstance(value, frozenset):  # members in the order of their encoding, never of their hashes
        return b"{" + b"".join(sorted(const_bytes(v) for v in value)) + b"}"
    if isinstance(value, types.CodeType):
        return _sized(b"C", code_digest(value).encode())
    raise CacheKeyError(f"code: a constant of type {type(value).__name__} has no canonical form")


def code_digest(code: types.CodeType) -> str:
    """SHA-256 of what ``code`` runs (see module doc); the same in every process, on every path and line."""
    h = hashlib.sha256()
    h.update(_sized(b"code", code.co_code))
    h.update(_sized(b"exc", getattr(code, "co_exceptiontable", b"")))
    for name in ("co_names", "co_varnames", "co_freevars", "co_cellvars"):
        h.update(const_bytes(tuple(getattr(code, name))))
    counts = (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags, code.co_nlocals)
    h.update(const_bytes(counts))
    h.update(const_bytes(code.co_name))
    h.update(b"[" + b"".join(const_bytes(c) for c in code.co_consts) + b"]")
    return h.hexdigest()


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def global_names(code: types.CodeType) -> list[str]:
    """The names ``code`` (and the code nested in it: comprehensions, inner functions) loads as globals."""
    names: set[str] = set()
    for c in _codes(code):
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str):
                names.add(ins.argval)
    return sorted(names)


def import_name(value: Any) -> str | None:
    """``module.qualname`` when importing that name gives ``value`` itself; None otherwise."""
    owner = getattr(value, "__objclass__", None)  # a method descriptor (``torch.Tensor.relu``)
    if owner is not None and isinstance(getattr(value, "__name__", None), str):
        base = import_name(owner)
        return None if base is None else f"{base}.{value.__name__}"
    module = getattr(value, "__module__", None)
    if isinstance(value, types.BuiltinFunctionType) and module is None:
        module = "builtins" if getattr(builtins, getattr(value, "__name__", ""), None) is value else None
    if not isinstance(module, str):
        return None
    # torch's builtins name a private class in ``__qualname__`` (``_VariableFunctionsClass.tanh``): the
    # name they are imported by is then ``__name__``.
    for name in (getattr(value, "__qualname__", None), getattr(value, "__name__", None)):
        if not isinstance(name, str) or "<locals>" in name:
            continue
        try:
            obj: Any = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
        except Exception:  # noqa: BLE001 - not importable by that name
            continue
        if obj is value:
            return f"{module}.{name}"
    return None


def is_torch_code(value: Any) -> bool:
    """Whether ``value`` is defined by torch itself (its code is keyed by torch's version and build)."""
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and (module == "torch" or module.startswith("torch."))


@dataclass
class Watch:
    """Objects a key was built from that the program can rebind: ``(namespace, name, object, form)``.

    :meth:`changed` is the per-call check of one process: identity first
    (cheap), and for small containers their members' identities (a list can
    change in place; a member changed inside a member is not seen).
    """

    items: list[tuple[MutableMapping[str, Any], str, Any, Any]] = field(default_factory=list)
    _seen: set[tuple[int, str]] = field(default_factory=set)
    #: The Python modules whose functions' globals are read (the modules defining the module tree's classes).
    home: frozenset[str] = frozenset()
    #: Forms of the functions already met while building one key (each function's code is read once).
    memo: dict[tuple[int, bool], Any] = field(default_factory=dict)

    def add(self, namespace: MutableMapping[str, Any], name: str, obj: Any, form: Any) -> None:
        mark = (id(namespace), name)
        if mark not in self._seen:
            self._seen.add(mark)
            small = isinstance(obj, _CONTAINERS) and len(obj) <= _WATCHED_ITEMS
            self.items.append((namespace, name, obj, _members(obj) if small else None))

    def changed(self) -> str | None:
        """The first name whose object is not the one keyed (or a small container whose members changed)."""
        for namespace, name, obj, members in self.items:
            now = namespace.get(name, _MISSING)
            if now is obj:
                if members is None or _members(now) == members:
                    continue
                return name
            if isinstance(now, _PLAIN) and type(now) is type(obj) and canonical(now) == canonical(obj):
                continue  # rebound to an equal plain value
            return name
        return None


def _members(obj: Any) -> tuple[Any, ...]:
    """A container's members by identity (keys by value): cheap enough for every call, and a change shows."""
    if isinstance(obj, dict):
        return tuple((k, id(v)) for k, v in obj.items())
    if isinstance(obj, (set, frozenset)):
        return tuple(sorted(id(v) for v in obj))
    return tuple(id(v) for v in obj)


def _check_depth(depth: int, what: Any) -> None:
    if depth > 4 * _MAX_DEPTH:
        raise CacheKeyError(f"code: values nested more than {4 * _MAX_DEPTH} deep at {type(what).__name__}")


def value_form(value: Any, watch: Watch | None = None, depth: int = 0, stack: tuple[int, ...] = ()) -> Any:
    """``value`` as canonical JSON data (see module doc); ``watch`` collects the globals functions read."""
    _check_depth(depth, value)
    if isinstance(value, _PLAIN):
        if isinstance(value, float) and not math.isfinite(value):
            return {"float": repr(value)}
        return value
    if isinstance(value, enum.Enum):
        return {"enum": _class_name(type(value)), "value": value_form(value.value, watch, depth + 1, stack)}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return {type(value).__name__: str(value)}
    if isinstance(value, (list, tuple)):
        return {
            type(value).__name__ if type(value) in (list, tuple) else _class_name(type(value)): [
                value_form(v, watch, depth + 1, stack) for v in value
            ]
        }
    if isinstance(value, (set, frozenset)):
        items = [value_form(v, watch, depth + 1, stack) for v in value]
        return {"set": sorted(items, key=canonical_json)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"dict": {k: value_form(v, watch, depth + 1, stack) for k, v in sorted(value.items())}}
        pairs = [
            [value_form(k, watch, depth + 1, stack), value_form(v, watch, depth + 1, stack)] for k, v in value.items()
        ]
        return {"items": sorted(pairs, key=canonical_json)}
    if isinstance(value, types.ModuleType):
        return {"module": value.__name__}
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return {"op": str(value)}
    if isinstance(value, type):
        return _class_form(value)
    if isinstance(value, functools.partial):
        return {
            "partial": value_form(value.func, watch, depth + 1, stack),
            "args": [value_form(v, watch, depth + 1, stack) for v in value.args],
            "keywords": {k: value_form(v, watch, depth + 1, stack) for k, v in sorted(value.keywords.items())},
        }
    if isinstance(value, types.FunctionType) and not is_torch_code(value):
        return function_form(value, watch, depth, stack)
    if isinstance(value, types.MethodType) and not isinstance(value.__self__, (type, types.ModuleType)):
        owner = value.__self__  # a method of an object: its code, and the object by its type
        return {"method": value_form(value.__func__, watch, depth + 1, stack), "self": _object_form(owner)}
    name = import_name(value)
    if name is not None and callable(value):  # builtins, torch's functions, a classmethod of an importable class
        return {"function": name}
    if isinstance(value, torch.Tensor):  # data: what it holds is not known from its type
        raise CacheKeyError(f"code: a tensor ({tuple(value.shape)}, {value.dtype}) has no canonical form")
    # Any other object (a logger, a configuration, a callable object): by its type; the per-call check of
    # the process watches it by identity where it was read from a global or an attribute.
    return _object_form(value)


def _object_form(value: Any) -> dict[str, Any]:
    return {"object": _class_name(type(value)), "callable": callable(value)}


def opaque(form: Any) -> bool:
    """Whether ``form`` stands for a callable known only by its type (an object, or a method of one)."""
    if not isinstance(form, dict):
        return False
    if form.get("callable") is True:
        return True
    return "method" in form and opaque(form.get("self"))


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_form(cls: type) -> dict[str, Any]:
    """A class by its import name: the code of the program's own classes is in the key through their source."""
    return {"class": _class_name(cls)}


def _function_of(member: Any) -> types.FunctionType | None:
    """The Python function a class member runs (a method, static or class method, a property's getter)."""
    fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
    return fn if isinstance(fn, types.FunctionType) else None


def function_form(
    fn: types.FunctionType,
    watch: Watch | None = None,
    depth: int = 0,
    stack: tuple[int, ...] = (),
    *,
    reads: bool | None = None,
) -> dict[str, Any]:
    """What ``fn`` runs: its code, defaults and closure cells, each canonically, and the globals it reads.

    The globals are read (by value, :func:`globals_form`) when ``reads`` is
    True, or when it is None and ``fn`` is defined in one of ``watch.home``
    (the modules of the model's own classes, whose source the key holds):
    the values a model's own module sets.  Another library's function is its
    code and what it carries, its globals are that library's (versions keyed).
    A function met again while its own form is being built (recursion) is
    named, not followed; its ``__wrapped__`` chain (a decorator's target) is
    followed too: the wrapper may call it.
    """
    if id(fn) in stack:
        return {"recursive": fn.__qualname__}
    home = watch.home if watch is not None else frozenset()
    follow = reads if reads is not None else fn.__module__ in home
    memo_key = (id(fn), follow)
    if watch is not None and memo_key in watch.memo:
        return watch.memo[memo_key]  # type: ignore[no-any-return]
    code = fn.__code__
    out: dict[str, Any] = {"qualname": fn.__qualname__, "code": code_digest(code)}
    if depth > _MAX_DEPTH:  # far from forward: its code, not what it carries
        return out
    stack = (*stack, id(fn))
    if fn.__defaults__:
        out["defaults"] = [value_form(v, watch, depth + 1, stack) for v in fn.__defaults__]
    if fn.__kwdefaults__:
        out["kwdefaults"] = {k: value_form(v, watch, depth + 1, stack) for k, v in sorted(fn.__kwdefaults__.items())}
    if fn.__closure__:
        cells: dict[str, Any] = {}
        for name, cell in zip(code.co_freevars, fn.__closure__, strict=True):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned after the function was made)
                cells[name] = {"empty": True}
                continue
            cells[name] = value_form(contents, watch, depth + 1, stack)
        out["closure"] = cells
    if follow:
        read = globals_form(fn, watch, depth, stack)
        if read:
            out["globals"] = read
    wrapped = getattr(fn, "__wrapped__", None)
    if isinstance(wrapped, types.FunctionType):
        out["wrapped"] = value_form(wrapped, watch, depth + 1, stack)
    if watch is not None:
        watch.memo[memo_key] = out
    return out


def globals_form(
    fn: types.FunctionType, watch: Watch | None = None, depth: int = 0, stack: tuple[int, ...] = ()
) -> dict[str, Any]:
    """The globals ``fn``'s code loads, by value (builtins by name); each noted in ``watch``."""
    out: dict[str, Any] = {}
    scope = fn.__globals__
    for name in global_names(fn.__code__):
        value = scope.get(name, _MISSING)
        if value is _MISSING:
            found = getattr(builtins, name, _MISSING)
            out[name] = {"builtin": name} if found is not _MISSING else {"missing": True}
            continue
        form = value_form(value, watch, depth + 1, stack)
        out[name] = form
        if watch is not None:
            watch.add(scope, name, value, form)
    return out
