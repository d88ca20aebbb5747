"""Checks on the names a snapshot payload supplies, before any of them reaches generated code.

Node names, argument names and attribute paths end up in the Python source FX
generates on restore, and attribute access at run time could walk from a
tensor to arbitrary objects; so every name is checked here first (docs/snapshots.md,
"Threat model"): identifiers only, no dunders, ``getattr`` with
a literal name, pytree types resolved under the allow-list.  Identifiers and
digit strings are ASCII: ``str.isidentifier`` takes ``ｘ``, which Python
reads as ``x`` once it is source (NFKC), and ``str.isdigit`` takes ``²``.
"""

from __future__ import annotations

import json
import keyword
import re
from collections.abc import Sequence
from typing import Any

from adstore.integration.errors import CorruptSnapshot, UntrustedTarget
from adstore.integration.snapshot.targets import resolve_target

__all__ = [
    "attr_path",
    "is_identifier",
    "is_member_name",
    "check_attribute_access",
    "check_pytree_types",
    "identifier",
    "member_name",
    "placeholder_target",
]

_PYTREE_BUILTIN_TYPES = frozenset(
    {
        None,
        "builtins.tuple",
        "builtins.list",
        "builtins.dict",
        "collections.OrderedDict",
        "collections.defaultdict",
        "collections.deque",
        "torch.Size",
    }
)


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_DIGITS = re.compile(r"[0-9]+", re.ASCII)


def is_identifier(name: object) -> bool:
    """An ASCII Python identifier (keywords included: the callers decide about those)."""
    return type(name) is str and _IDENTIFIER.fullmatch(name) is not None


def is_member_name(name: object) -> bool:
    """One part of a module path: an ASCII identifier or ASCII digits (``layers.0``)."""
    return type(name) is str and (_IDENTIFIER.fullmatch(name) is not None or _DIGITS.fullmatch(name) is not None)


def identifier(name: Any, what: str) -> str:
    if not is_identifier(name) or keyword.iskeyword(name):
        raise CorruptSnapshot(f"{what} {name!r} is not a valid identifier")
    return name


def member_name(name: Any, what: str) -> str:
    """A submodule/parameter/buffer name: an identifier or a digit string (``layers.0``), no dunders."""
    if not is_member_name(name):
        raise CorruptSnapshot(f"{what} {name!r} is not a valid member name")
    if name.startswith("__") and name.endswith("__"):
        raise UntrustedTarget(name)
    return name


def _has_dunder_string(value: Any) -> bool:
    if type(value) is str:
        return value.startswith("__") and value.endswith("__") and len(value) > 4
    if type(value) in (tuple, list):
        return any(_has_dunder_string(v) for v in value)
    if type(value) is dict:
        return any(_has_dunder_string(k) or _has_dunder_string(v) for k, v in value.items())
    return False


def check_attribute_access(name: str, target: object, args: tuple, kwargs: dict) -> None:
    """Keep a restored graph from reaching objects it does not name.

    Targets resolve only under the allow-list, but attribute access at run time
    could walk from a tensor to ``__class__.__init__.__globals__`` and from there
    to anything.  So ``getattr``/``hasattr`` take a literal, non-dunder name, and
    no argument of a call is a dunder string.
    """
    if target is getattr or target is hasattr:
        attr = args[1] if len(args) > 1 else kwargs.get("name")
        if type(attr) is not str or attr.startswith("__"):
            raise UntrustedTarget(f"{getattr(target, '__name__', target)}(…, {attr!r}) in node {name!r}")
    if _has_dunder_string(args) or _has_dunder_string(kwargs):
        raise UntrustedTarget(f"a dunder attribute name in the arguments of node {name!r}")


def attr_path(path: Any, what: str) -> str:
    if not isinstance(path, str) or not path:
        raise CorruptSnapshot(f"{what} {path!r} is not an attribute path")
    for part in path.split("."):
        if not is_member_name(part) or (part.startswith("__") and part.endswith("__")):
            raise UntrustedTarget(path) if "__" in part else CorruptSnapshot(f"bad {what} {path!r}")
    return path


def placeholder_target(t: Any) -> str:
    if isinstance(t, str):
        bare = t[2:] if t.startswith("**") else t[1:] if t.startswith("*") else t
        identifier(bare, "placeholder")
        return t
    raise CorruptSnapshot(f"placeholder target {t!r} is not a string")


def check_pytree_types(spec_json: str, extra: Sequence[str]) -> None:
    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            raise CorruptSnapshot("bad pytree spec")
        t = node.get("type")
        if t not in _PYTREE_BUILTIN_TYPES:
            # Resolving imports the (allow-listed) module, which registers its pytree nodes.
            resolve_target(t, extra) if isinstance(t, str) else None
            if not isinstance(t, str):
                raise CorruptSnapshot(f"bad pytree type {t!r}")
        for child in node.get("children_spec", []):
            walk(child)

    try:
        data = json.loads(spec_json)
    except (TypeError, ValueError) as exc:
        raise CorruptSnapshot(f"bad pytree spec: {exc}") from exc
    if not isinstance(data, list) or len(data) != 2:
        raise CorruptSnapshot("bad pytree spec")
    walk(data[1])
