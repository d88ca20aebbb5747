"""Load-state-dict hooks as declarative JSON specs, with a registry of hook types.

A snapshot never pickles hooks.  :func:`collect_hook_specs` walks the module
tree and turns every load-state-dict pre-hook and post-hook into a JSON spec::

    {"type": "shard_tp", "scope": "layers.0.attn", "phase": "pre",
     "with_module": false, "params": {...}}

``scope`` is the dotted path from the saved root, ``phase`` is ``pre`` or
``post`` and ``with_module`` says whether the hook receives the module first
(post-hooks always do).  The hook *type* decides how ``params`` is written
(``encode``) and turned back into a callable (``rebuild``).  Built-in types:

* ``shard_tp``, ``dedup``, ``alias`` — :class:`TPShardHook`, :class:`DedupHook`,
  :class:`AliasHook` (whole state is JSON);
* ``importable`` — a module-level function, a ``functools.partial`` of one with
  keyword arguments only, a method bound to the scope module itself, or a
  method/callable instance of an importable class whose public attributes are
  plain data (rebuilt without running ``__init__``).

Other code adds types with :func:`register_hook_type`.  A hook no type accepts
(closures, lambdas, objects with private state) raises
:class:`~adstore.integration.errors.UnsupportedHook` naming it, so the save
skips.  Rebuilding resolves every name under the allow-list of
:mod:`adstore.integration.snapshot.targets`.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from adstore.integration.errors import CorruptSnapshot, UnsupportedHook, UntrustedTarget
from adstore.integration.snapshot.hook_builtins import AliasHook, DedupHook, TPShardHook
from adstore.integration.snapshot.names import is_member_name
from adstore.integration.snapshot.targets import check_prefix, qualname_of, resolve_target
from adstore.integration.snapshot.values import Unencodable, ValueDecoder, ValueEncoder

__all__ = [
    "HookType",
    "TPShardHook",
    "DedupHook",
    "AliasHook",
    "register_hook_type",
    "hook_types",
    "collect_hook_specs",
    "clear_load_hooks",
    "restore_load_hooks",
    "reattach_hooks",
    "SavedHooks",
]

logger = logging.getLogger(__name__)

_PHASES = ("pre", "post")
# Extra allow-list prefixes in force while reattach_hooks rebuilds (read by rebuild functions).
_extra_prefixes: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("adstore_hook_prefixes", default=())


@dataclass(frozen=True)
class HookType:
    """How one kind of hook becomes JSON (``encode``) and a callable again (``rebuild``).

    ``match(hook)`` selects the type; ``encode(hook, module)`` returns JSON-safe
    params (``module`` is the module the hook is registered on);
    ``rebuild(params, module)`` returns the callable to register.
    ``phases`` / ``with_module`` restrict where the type is valid.
    """

    name: str
    match: Callable[[object], bool]
    encode: Callable[[object, torch.nn.Module], dict]
    rebuild: Callable[[dict, torch.nn.Module], Callable]
    phases: tuple[str, ...] = _PHASES
    with_module: tuple[bool, ...] = (False, True)


_builtin_types: dict[str, HookType] = {}
_user_types: dict[str, HookType] = {}


def register_hook_type(
    name: str,
    *,
    match: Callable[[object], bool],
    encode: Callable[[object, torch.nn.Module], dict],
    rebuild: Callable[[dict, torch.nn.Module], Callable],
    phases: Sequence[str] = _PHASES,
    with_module: Sequence[bool] = (False, True),
    replace: bool = False,
) -> HookType:
    """Add a hook type (process-wide).  User types are tried before the built-in ones."""
    if not isinstance(name, str) or not name.replace("_", "").isalnum():
        raise ValueError(f"hook type name {name!r} must be alphanumeric/underscore")
    if (name in _user_types or name in _builtin_types) and not replace:
        raise ValueError(f"hook type {name!r} is already registered (pass replace=True)")
    if any(p not in _PHASES for p in phases):
        raise ValueError(f"phases must be a subset of {_PHASES}")
    ht = HookType(name, match, encode, rebuild, tuple(phases), tuple(bool(w) for w in with_module))
    _user_types[name] = ht
    return ht


def hook_types() -> dict[str, HookType]:
    """All registered types by name (user types first, in lookup order)."""
    return {**_user_types, **{k: v for k, v in _builtin_types.items() if k not in _user_types}}


def _builtin(ht: HookType) -> None:
    _builtin_types[ht.name] = ht


# ----------------------------------------------------------------------------- spec-state built-ins
for _name, _cls in (("shard_tp", TPShardHook), ("dedup", DedupHook), ("alias", AliasHook)):
    _builtin(
        HookType(
            _name,
            match=functools.partial(lambda cls, h: type(h) is cls, _cls),
            encode=lambda h, m: h.to_spec(),
            rebuild=functools.partial(lambda cls, params, m: cls.from_spec(params), _cls),
            phases=("pre",),
            with_module=(False,),
        )
    )


# ----------------------------------------------------------------------------- importable
def _plain_state(obj: object) -> dict[str, Any] | None:
    """Public attributes of ``obj`` as structural JSON, or None if any is private or not plain."""
    state = getattr(obj, "__dict__", None)
    if state is None or any(k.startswith("_") for k in state):
        return None
    enc = ValueEncoder()
    try:
        out = {k: enc.encode(v, specs=None) for k, v in state.items()}
    except Unencodable:
        return None
    return None if enc.tensors else out


def _owner_class_ok(cls: type) -> bool:
    return (
        isinstance(cls, type)
        and cls.__new__ is object.__new__
        and not issubclass(cls, torch.nn.Module)
        and "__slots__" not in cls.__dict__
    )


def _encode_callable(fn: object, module: torch.nn.Module) -> dict[str, Any] | None:
    if isinstance(fn, functools.partial):
        if fn.args:
            return None
        inner = _encode_callable(fn.func, module)
        kw = _plain_state(types.SimpleNamespace(**fn.keywords)) if fn.keywords else {}
        if inner is None or kw is None or inner["kind"] == "partial":
            return None
        return {"kind": "partial", "target": inner, "keywords": kw}
    if isinstance(fn, types.MethodType):
        owner, func = fn.__self__, fn.__func__
        if owner is module:
            q = qualname_of(func)
            return None if q is None else {"kind": "method", "bound": "module", "func": q}
        cls = type(owner)
        q = qualname_of(cls)
        state = _plain_state(owner)
        name = func.__name__
        if q is None or state is None or not _owner_class_ok(cls) or getattr(cls, name, None) is not func:
            return None
        return {"kind": "method", "bound": "owner", "owner_class": q, "owner_state": state, "func": name}
    if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
        q = qualname_of(fn)
        return None if q is None else {"kind": "function", "qualname": q}
    cls = type(fn)
    if callable(fn) and not isinstance(fn, type) and _owner_class_ok(cls):
        q = qualname_of(cls)
        state = _plain_state(fn)
        if q is not None and state is not None:
            return {"kind": "instance", "owner_class": q, "owner_state": state}
    return None


def _rebuild_owner(params: Mapping[str, Any], extra: Sequence[str]) -> object:
    cls = resolve_target(params["owner_class"], extra)
    if not _owner_class_ok(cls):  # type: ignore[arg-type]
        raise UntrustedTarget(str(params["owner_class"]))
    obj = object.__new__(cls)  # type: ignore[call-overload]
    dec = ValueDecoder(extra_prefixes=extra)
    state = params.get("owner_state", {})
    if not isinstance(state, dict) or any(not isinstance(k, str) or k.startswith("_") for k in state):
        raise CorruptSnapshot("bad hook owner state")
    obj.__dict__.update({k: dec.decode(v) for k, v in state.items()})
    return obj


def _rebuild_callable(params: Mapping[str, Any], module: torch.nn.Module) -> Callable:
    extra = _extra_prefixes.get()
    kind = params.get("kind")
    if kind == "function":
        fn = resolve_target(params["qualname"], extra)
        if not isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)):
            raise UntrustedTarget(str(params["qualname"]))
        return fn
    if kind == "partial":
        kw = ValueDecoder(extra_prefixes=extra)
        keywords = {k: kw.decode(v) for k, v in params.get("keywords", {}).items()}
        return functools.partial(_rebuild_callable(params["target"], module), **keywords)
    if kind == "method":
        if params.get("bound") == "module":
            func = resolve_target(params["func"], extra)
            if not isinstance(func, types.FunctionType) or getattr(type(module), func.__name__, None) is not func:
                raise UntrustedTarget(str(params["func"]))
            return types.MethodType(func, module)
        owner = _rebuild_owner(params, extra)
        name = params.get("func")
        func = getattr(type(owner), name, None) if isinstance(name, str) and not name.startswith("__") else None
        if not isinstance(func, types.FunctionType):
            raise UntrustedTarget(f"{params.get('owner_class')}.{name}")
        return types.MethodType(func, owner)
    if kind == "instance":
        owner = _rebuild_owner(params, extra)
        if not callable(owner):
            raise UntrustedTarget(str(params.get("owner_class")))
        return owner  # type: ignore[return-value]
    raise CorruptSnapshot(f"unknown importable hook kind {kind!r}")


_NO_MODULE = torch.nn.Module()  # stands in for "no scope module" while matching

_builtin(
    HookType(
        "importable",
        # Methods always match so that one with an unrepresentable owner is reported by name.
        match=lambda h: isinstance(h, types.MethodType) or _encode_callable(h, _NO_MODULE) is not None,
        encode=lambda h, m: _require(_encode_callable(h, m), h),
        rebuild=_rebuild_callable,
    )
)


def _require(params: dict[str, Any] | None, hook: object) -> dict[str, Any]:
    if params is None:
        raise UnsupportedHook(
            f"hook {hook!r} is not an importable function, keyword-only partial or method with a plain-data owner",
            detail=repr(hook),
        )
    return params


# ----------------------------------------------------------------------------- collect / clear / reattach
def _iter_load_hooks(module: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module, str, bool, object]]:
    for scope, m in module.named_modules():
        for wrapped in m._load_state_dict_pre_hooks.values():
            fn = getattr(wrapped, "hook", wrapped)
            with_module = bool(getattr(wrapped, "with_module", False))
            if with_module and wrapped.module() is not m:
                raise UnsupportedHook(f"{scope or '<root>'}: with_module hook bound to another module", detail=scope)
            yield scope, m, "pre", with_module, fn
        for fn in m._load_state_dict_post_hooks.values():
            yield scope, m, "post", True, fn


def collect_hook_specs(module: torch.nn.Module) -> list[dict[str, Any]]:
    """JSON specs of every load-state-dict hook in ``module``'s tree, in registration order.

    Raises :class:`UnsupportedHook` naming the first hook no registered type accepts.
    """
    specs = []
    for scope, m, phase, with_module, fn in _iter_load_hooks(module):
        where = scope or "<root>"
        for ht in hook_types().values():
            if not ht.match(fn):
                continue
            if phase not in ht.phases or with_module not in ht.with_module:
                raise UnsupportedHook(
                    f"{where}: {ht.name} hook {fn!r} registered as {phase} "
                    f"hook with_module={with_module}, which that type does not support",
                    detail=scope,
                )
            params = ht.encode(fn, m)
            try:
                json.dumps(params, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise UnsupportedHook(
                    f"{where}: {ht.name} encoder returned non-JSON params: {exc}", detail=scope
                ) from exc
            specs.append(
                {"type": ht.name, "scope": scope, "phase": phase, "with_module": with_module, "params": params}
            )
            break
        else:
            raise UnsupportedHook(
                f"{where}: load-state-dict {phase}-hook {fn!r} has no spec type "
                "(closures and unknown objects are not cached)",
                detail=scope,
            )
    return specs


SavedHooks = list[tuple[torch.nn.Module, dict, dict]]


def clear_load_hooks(module: torch.nn.Module) -> SavedHooks:
    """Remove every load-state-dict hook in the tree; returns what :func:`restore_load_hooks` needs."""
    saved: SavedHooks = []
    for _, m in module.named_modules():
        saved.append((m, dict(m._load_state_dict_pre_hooks), dict(m._load_state_dict_post_hooks)))
        m._load_state_dict_pre_hooks.clear()
        m._load_state_dict_post_hooks.clear()
    return saved


def restore_load_hooks(saved: SavedHooks) -> None:
    """Put back exactly the hooks :func:`clear_load_hooks` removed (same dict objects, so handles work)."""
    for m, pre, post in saved:
        m._load_state_dict_pre_hooks.clear()
        m._load_state_dict_pre_hooks.update(pre)
        m._load_state_dict_post_hooks.clear()
        m._load_state_dict_post_hooks.update(post)


def _scope_module(root: torch.nn.Module, scope: Any) -> torch.nn.Module:
    if not isinstance(scope, str):
        raise CorruptSnapshot(f"bad hook scope {scope!r}")
    if scope == "":
        return root
    m = root
    for part in scope.split("."):
        if not is_member_name(part):
            raise CorruptSnapshot(f"bad hook scope {scope!r}")
        child = m._modules.get(part)
        if child is None:
            raise CorruptSnapshot(f"hook scope {scope!r} names no submodule")
        m = child
    return m


def reattach_hooks(
    module: torch.nn.Module, specs: Sequence[Mapping[str, Any]], *, allowed_prefixes: Sequence[str] = ()
) -> int:
    """Rebuild and register hooks from ``specs`` (all validated before any is registered).

    Returns the number registered.  Unknown types raise :class:`UnsupportedHook`;
    names outside the allow-list raise :class:`UntrustedTarget`.
    """
    if not isinstance(specs, (list, tuple)):
        raise CorruptSnapshot("hook specs must be a list")
    types_ = hook_types()
    token = _extra_prefixes.set(tuple(check_prefix(p) for p in allowed_prefixes))
    try:
        plan = []
        for spec in specs:
            if not isinstance(spec, Mapping):
                raise CorruptSnapshot("hook spec is not an object")
            ht = types_.get(spec.get("type"))  # type: ignore[arg-type]
            if ht is None:
                raise UnsupportedHook(f"unknown hook type {spec.get('type')!r}", detail=spec.get("type"))
            phase, with_module = spec.get("phase"), spec.get("with_module")
            if phase not in ht.phases or with_module not in ht.with_module or (phase == "post" and not with_module):
                raise CorruptSnapshot(f"hook spec {ht.name} has invalid phase/with_module {phase}/{with_module}")
            params = spec.get("params")
            if not isinstance(params, dict):
                raise CorruptSnapshot("hook params must be an object")
            m = _scope_module(module, spec.get("scope"))
            try:
                fn = ht.rebuild(params, m)
            except (KeyError, TypeError, ValueError) as exc:
                if isinstance(exc, (UntrustedTarget, UnsupportedHook)):
                    raise
                raise CorruptSnapshot(f"hook spec {ht.name} at {spec.get('scope')!r} does not rebuild: {exc}") from exc
            plan.append((m, phase, with_module, fn))
    finally:
        _extra_prefixes.reset(token)
    for m, phase, with_module, fn in plan:
        if phase == "pre":
            m._register_load_state_dict_pre_hook(fn, with_module=with_module)
        else:
            m.register_load_state_dict_post_hook(fn)
    return len(plan)
