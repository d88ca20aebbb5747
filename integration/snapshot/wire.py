"""The snapshot wire format: the one module that knows its envelope and its positional records.

``module.pt`` is a weights-only ``torch.save`` of a plain dict (docs/snapshots.md,
"What a snapshot holds")::

    {"format": FORMAT, "version": VERSION, "structure": <JSON text>, "tensors": [real tensors]}

The structure holds the module tree.  Each module is a dict record (``class``,
``training``, ``params``, ``buffers``, ``attrs``, ``children``, and for a
GraphModule ``graph`` and ``methods``), or ``{"alias": path}`` for a module
already written.  Two records are positional lists, because a transformer
graph has thousands of them and names per field would double the JSON:

* a graph node: ``[name, op, target, args, kwargs, type, meta]``
  (:class:`NodeRecord`); ``target`` is an index into the graph's ``targets``
  for ``call_function``, a string otherwise;
* a parameter: ``["P", shape, stride, dtype, requires_grad]`` (a meta
  tensor's spec), or ``["alias", path]`` for a parameter written earlier.

The encoder, the decoder and ``summarize`` build and read these records only
through the functions here.  Argument values inside a record use the tagged
encoding of :mod:`adstore.integration.snapshot.values`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

from adstore.integration.errors import CorruptSnapshot

__all__ = [
    "FORMAT",
    "HOOKS_ARTIFACT",
    "MODULE_ARTIFACT",
    "VERSION",
    "NodeRecord",
    "ParamSpec",
    "alias_of",
    "alias_ref",
    "check_structure",
    "iter_modules",
    "module_alias",
    "module_alias_of",
    "new_structure",
    "pack_node",
    "pack_param",
    "param_of",
    "unpack_node",
    "unpack_param",
]

FORMAT = "adstore.snapshot"
VERSION = 1
MODULE_ARTIFACT = "module.pt"
HOOKS_ARTIFACT = "hooks.json"

_PARAM_TAG = "P"
_ALIAS_TAG = "alias"


# ----------------------------------------------------------------- envelope
def new_structure(
    *, torch_version: str, graph_modules: int, symbols: Any, meta_table: list[Any], tree: dict[str, Any]
) -> dict[str, Any]:
    """The structure dict of one snapshot (serialised as one JSON string)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "torch": torch_version,
        "graph_modules": graph_modules,
        "symbols": symbols,
        "meta_table": meta_table,
        "tree": tree,
    }


def check_structure(structure: Any) -> dict[str, Any]:
    """``structure`` if it is a snapshot structure of this format and version, else CorruptSnapshot."""
    if (
        not isinstance(structure, dict)
        or structure.get("format") != FORMAT
        or structure.get("version") != VERSION
        or not isinstance(structure.get("tree"), dict)
    ):
        raise CorruptSnapshot("snapshot structure is malformed or of another version")
    return structure


# --------------------------------------------------------------- graph nodes
class NodeRecord(NamedTuple):
    """One graph node as written: its fields in wire order."""

    name: Any
    op: Any
    target: Any
    args: Any
    kwargs: Any
    type: Any
    meta: Any


def pack_node(
    name: str, op: str, target: Any, args: Any, kwargs: Any, type_: str | None, meta: dict[str, Any]
) -> list[Any]:
    return [name, op, target, args, kwargs, type_, meta]


def unpack_node(rec: Any) -> NodeRecord:
    """The fields of a node record (not yet validated); CorruptSnapshot if it has the wrong shape."""
    if type(rec) is not list or len(rec) != len(NodeRecord._fields):
        raise CorruptSnapshot("bad node record")
    return NodeRecord(*rec)


# ---------------------------------------------------------------- parameters
class ParamSpec(NamedTuple):
    shape: list[Any]
    stride: list[Any]
    dtype: str
    requires_grad: bool


def pack_param(shape: list[int], stride: list[int], dtype: str, requires_grad: bool) -> list[Any]:
    return [_PARAM_TAG, shape, stride, dtype, requires_grad]


def unpack_param(spec: Any) -> ParamSpec:
    """A parameter spec's fields; CorruptSnapshot for anything else (an alias included)."""
    param = param_of(spec)
    if param is None:
        raise CorruptSnapshot(f"bad parameter spec {str(spec)[:80]}")
    return param


def param_of(spec: Any) -> ParamSpec | None:
    """The fields of a full parameter spec; None for an absent parameter, an alias or junk."""
    if type(spec) is list and len(spec) == 5 and spec[0] == _PARAM_TAG:
        return ParamSpec(spec[1], spec[2], spec[3], spec[4])
    return None


def alias_of(ref: Any) -> str | None:
    """The path a ``["alias", path]`` reference names, else None."""
    if type(ref) is list and len(ref) == 2 and ref[0] == _ALIAS_TAG and type(ref[1]) is str:
        return ref[1]
    return None


def alias_ref(path: str) -> list[str]:
    return [_ALIAS_TAG, path]


# --------------------------------------------------------------------- tree
def module_alias(path: str) -> dict[str, str]:
    """The record of a module already written at ``path`` (a tie that survives a restore)."""
    return {_ALIAS_TAG: path}


def module_alias_of(record: dict[str, Any]) -> str | None:
    """The path a module alias record names, else None (a full module record)."""
    if _ALIAS_TAG not in record:
        return None
    path = record[_ALIAS_TAG]
    if type(path) is not str:
        raise CorruptSnapshot(f"bad module alias {path!r}")
    return path


def iter_modules(tree: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """``(path, record)`` for every module record written in full (aliases skipped), parents first."""
    if not isinstance(tree, dict) or _ALIAS_TAG in tree:
        return
    yield path, tree
    for name, child in tree.get("children", ()):
        yield from iter_modules(child, f"{path}.{name}" if path else str(name))
