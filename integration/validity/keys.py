"""Cache keys: SHA-256 over canonical JSON of named components (docs/pipeline-cache.md, "Keys").

Components: ``model`` (factory identity), ``checkpoint`` (cheap fingerprint),
``prefix`` (every transform before the cache point: name + config, from the
copy taken before any transform ran), ``dist`` (topology without the rank,
only when the prefix reaches sharding), ``env`` (adstore format version,
torch version and build, Python version and ABI, transformers version and a
fingerprint of the prefix transforms' source code) and ``extra`` (caller's
own).  The components are stored with the entry so ``adstore explain`` can
say which one made two keys differ.

Canonical JSON: sorted keys, no whitespace, floats by their shortest exact
repr (non-finite floats spelled out), paths as POSIX strings, enums by value,
tuples and sets as lists, dtypes and devices by name.  Anything else is a
:class:`CacheKeyError`, never a silently lossy ``str()``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import torch

from adstore.integration.errors import CacheKeyError
from adstore.integration.validity.envcheck import apply_overrides

__all__ = [
    "COMPONENTS",
    "FORMAT_VERSION",
    "CacheKey",
    "build_key",
    "canonical",
    "canonical_json",
    "code_fingerprint",
    "diff_components",
    "env_component",
    "environment_fingerprint",
    "json_digest",
]

#: Bump when the snapshot layout or the key recipe changes: old entries then miss.
FORMAT_VERSION = 1
COMPONENTS = ("model", "checkpoint", "prefix", "dist", "env", "extra")


def canonical(obj: Any, where: str = "key") -> Any:
    """A JSON-safe, normalised copy of ``obj`` (see module doc)."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return canonical(obj.value, where)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {"__float__": repr(obj)}
    if isinstance(obj, PurePath):
        return obj.as_posix()
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return canonical(dataclasses.asdict(obj), where)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if isinstance(k, enum.Enum):
                k = k.value
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CacheKeyError(f"{where}: mapping key {k!r} is not a string")
            out[str(k)] = canonical(v, f"{where}.{k}")
        return out
    if isinstance(obj, (list, tuple)):
        return [canonical(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        items = [canonical(v, where) for v in obj]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    raise CacheKeyError(f"{where}: {type(obj).__name__} value {obj!r} has no canonical form")


def canonical_json(obj: Any) -> str:
    """The one canonical JSON text of ``obj`` that keys and engine hashes are taken over."""
    return json.dumps(canonical(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def json_digest(obj: Any) -> str:
    """SHA-256 hex of :func:`canonical_json` of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def _module_source(modname: str) -> bytes:
    """The bytes of a module's source file (read, not parsed: this runs on every hit).

    A module not imported yet is found, not imported: a restart that only
    hashes code it will not run (the engine compiler on a hit) does not pay
    for its imports.
    """
    mod = sys.modules.get(modname)
    if mod is not None:
        path = getattr(mod, "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec(modname)
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None else None
    if path and path.endswith(".py") and os.path.exists(path):
        with open(path, "rb") as fh:
            return fh.read()
    try:
        return inspect.getsource(mod or importlib.import_module(modname)).encode()
    except (ImportError, OSError, TypeError):
        return f"<no source for {modname}>".encode()


def code_fingerprint(classes: Iterable[type | Callable[..., Any]]) -> dict[str, str]:
    """SHA-256 of the source of each class's (or function's) module and its ``code_modules``, and of what it binds.

    The whole defining module is hashed, not only the class body, because a
    transform's behaviour lives in the helpers beside it (and reading a file is
    much cheaper than locating a class in its parsed source).  A callable is
    more than its source: a closure's captured values, a function's defaults,
    a ``functools.partial``'s arguments and a callable object's attributes are
    hashed too (:func:`_bound`), so two lowerings made by one factory with
    different values differ, and a value with no canonical form is a
    :class:`CacheKeyError`, never a key by name alone.
    """
    return dict(_fingerprint(obj) for obj in classes)


def _fingerprint(obj: Any, stack: tuple[int, ...] = ()) -> tuple[str, str]:
    """``(name, digest)`` of one class or callable (see :func:`code_fingerprint`); ``stack``: the callables
    whose bound values led here (a function that captures itself is named, not followed)."""
    if len(stack) > _MAX_DEPTH:
        raise CacheKeyError(f"code: callables nested more than {_MAX_DEPTH} deep in {obj!r}")
    stack = (*stack, id(obj))
    code = obj.func if isinstance(obj, functools.partial) else obj
    if not isinstance(code, type) and not hasattr(code, "__qualname__"):
        code = type(code)  # a callable object: its class's code, its attributes below
    name = f"{code.__module__}.{code.__qualname__}"
    h = hashlib.sha256(code.__qualname__.encode())
    for modname in sorted({code.__module__, *getattr(code, "code_modules", ())}):
        h.update(b"\0" + modname.encode() + b"\0")
        h.update(_module_source(modname))
    bound = _bound(obj, stack)
    if bound:  # nothing is added for a plain class or function: their digests stay what they were
        h.update(b"\0bound\0" + canonical_json(bound).encode())
    if isinstance(obj, functools.partial):
        name = f"partial({name})"
    return name, h.hexdigest()


_MAX_DEPTH = 8


def _bound(obj: Any, stack: tuple[int, ...]) -> dict[str, Any]:
    """What a callable carries besides its code: closure cells, defaults, partial arguments, attributes."""
    out: dict[str, Any] = {}
    if isinstance(obj, functools.partial):
        out["args"] = [_value(v, stack) for v in obj.args]
        out["keywords"] = {k: _value(v, stack) for k, v in sorted(obj.keywords.items())}
        inner = _bound(obj.func, stack)
        if inner:
            out["func"] = inner
        return out
    if isinstance(obj, type):
        return out
    fn = getattr(obj, "__func__", obj)  # a bound method: its function, and what it is bound to
    if fn is not obj:
        out["self"] = _value(obj.__self__, stack)
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = getattr(fn, "__closure__", None) or ()
        if cells:
            out["closure"] = {n: _value(c.cell_contents, stack) for n, c in zip(code.co_freevars, cells, strict=True)}
        if getattr(fn, "__defaults__", None):
            out["defaults"] = [_value(v, stack) for v in fn.__defaults__]
        if getattr(fn, "__kwdefaults__", None):
            out["kwdefaults"] = {k: _value(v, stack) for k, v in sorted(fn.__kwdefaults__.items())}
    elif not hasattr(obj, "__qualname__"):  # a callable object
        out["attributes"] = (
            {k: _value(v, stack) for k, v in sorted(vars(obj).items())} if hasattr(obj, "__dict__") else {}
        )
    return out


def _value(value: Any, stack: tuple[int, ...]) -> Any:
    """A bound value in canonical form; callables by their own fingerprint, torch ops and modules by name."""
    if isinstance(value, types.ModuleType):
        return {"module": value.__name__}
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return {"op": str(value)}
    if callable(value) and not isinstance(value, (torch.dtype, torch.device)):
        if id(value) in stack:
            return {"recursive": getattr(value, "__qualname__", type(value).__qualname__)}
        return {"code": _fingerprint(value, stack)[1]}
    try:
        return canonical(value, "code")
    except CacheKeyError:
        raise CacheKeyError(
            f"code: a callable binds a {type(value).__name__} value ({value!r:.60}) with no canonical form"
        ) from None


def environment_fingerprint(code: Iterable[type | Callable[..., Any]] = ()) -> dict[str, Any]:
    """The ``env`` key component: the environment a snapshot is built in, and the code that built it.

    The adstore format, torch's version and build (its git commit), the Python
    version and extension ABI, transformers' version, and the source
    fingerprint of ``code`` (the prefix transforms, a user's own passes): an
    upgrade or a rebuild of any of them, or an edit of that code, is a miss
    rather than a stale hit, and a miss that finds the same request built
    under other values is ``incompatible_env`` naming the field
    (:mod:`~adstore.integration.validity.envcheck`).  Volatile facts (host,
    pid, paths, time) never enter it.  ``ADSTORE_ENV_OVERRIDES`` can simulate
    other values (tests).  Public as ``adstore.integration.environment_fingerprint``
    (docs/pipeline-cache.md, "Public API").
    """
    env: dict[str, Any] = {
        "adstore_format": FORMAT_VERSION,
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", "") or "",
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        # The suffix of compiled extensions (``.cpython-311-x86_64-linux-gnu.so``): implementation,
        # version, ABI flags (free-threaded, debug) and platform, without importing sysconfig.
        "python_abi": importlib.machinery.EXTENSION_SUFFIXES[0] if importlib.machinery.EXTENSION_SUFFIXES else "",
        "code": code_fingerprint(code),  # type: ignore[arg-type]
    }
    try:  # from the package metadata: whether this process imported transformers must not change the key
        env["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    return apply_overrides(env, "env")


#: The name the pipeline cache's key recipe has used since the start.
env_component = environment_fingerprint


@dataclass(frozen=True)
class CacheKey:
    """A key and the components it hashes (stored with the entry)."""

    key: str
    components: dict[str, Any]

    def __str__(self) -> str:
        return self.key


def build_key(
    *,
    model: Mapping[str, Any],
    checkpoint: Mapping[str, Any],
    prefix: list[Any],
    dist: Mapping[str, Any] | None,
    env: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> CacheKey:
    components = canonical(
        {"model": model, "checkpoint": checkpoint, "prefix": prefix, "dist": dist, "env": env, "extra": extra or {}}
    )
    return CacheKey(key=json_digest(components), components=components)


def diff_components(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Names of the components that differ between two keys' components.

    The pipeline's own components come first in :data:`COMPONENTS` order, then
    any other names (a :func:`~adstore.integration.cached_prefix` key's) sorted.
    """
    others = sorted((set(a) | set(b)) - set(COMPONENTS))
    return [c for c in (*COMPONENTS, *others) if canonical_json(a.get(c)) != canonical_json(b.get(c))]
