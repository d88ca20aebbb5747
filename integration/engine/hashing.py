"""Architecture hash of a compiled engine: graph structure, inputs, settings, toolchain.

The engine cache reuses a compiled engine for any model with the same
*architecture* and refits the current weights into it, so the hash must cover
everything that changes the generated code and nothing that is a weight:

* the graph: every node in order with its op, its target, its arguments and
  keyword arguments (literal values included, so ``leaky_relu(x, 0.1)`` and
  ``leaky_relu(x, 0.2)`` differ although the op sequence is the same), the
  tensor metadata of its result, and the topology (arguments refer to earlier
  nodes by position, not by name, so graphs that differ only in their input
  names share a hash);
* weights (parameters and buffers) by name, shape, dtype and stride only,
  never by value; lifted tensor constants (``torch.tensor([...])`` written in
  ``forward``) are code, so their *content* is hashed;
* the input specs: pytree structure, dtypes, shapes with symbolic dimensions
  renamed canonically, and the dynamic ranges of those symbols;
* the settings that change code generation and the toolchain
  (:mod:`adstore.integration.validity.toolchain`).

Components are hashed as the pipeline cache's keys are: SHA-256 over the one
canonical JSON (:func:`adstore.integration.validity.keys.canonical_json`).

Hashing reads metadata and never writes to the caller's parameters (unlike
the "zero the weights, then hash the module" approach).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import re
import types
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from adstore.integration.errors import CacheKeyError, ConfigError
from adstore.integration.validity.keys import code_fingerprint, json_digest
from adstore.integration.validity.toolchain import codegen_settings, toolchain_identity

__all__ = [
    "HASH_VERSION",
    "as_tuple",
    "call_spec",
    "get_hash",
    "graph_fingerprint",
    "hash_components",
    "input_specs",
    "tensor_digest",
]

#: Bumped whenever the canonical form below changes, so old engines become misses.
HASH_VERSION = 2

_SYMBOL_RE = re.compile(r"\b[a-zA-Z]+\d+\b")


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (dtype and shape included); reads, never writes."""
    with torch.no_grad():
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1)
        h = hashlib.sha256(f"{t.dtype}|{tuple(tensor.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.hexdigest()


# --------------------------------------------------------------------------- graph


class _Canon:
    """Canonical rendering of one graph: node positions and symbol names."""

    def __init__(self) -> None:
        self.node_index: dict[torch.fx.Node, int] = {}
        self.symbols: dict[str, str] = {}

    def sym(self, text: str) -> str:
        """Rename symbols (``s0``, ``s77``, ``u3``) by order of first appearance."""

        def repl(m: re.Match[str]) -> str:
            name = m.group(0)
            if not re.fullmatch(r"[su]\d+", name):
                return name
            if name not in self.symbols:
                self.symbols[name] = f"{name[0]}#{len(self.symbols)}"
            return self.symbols[name]

        return _SYMBOL_RE.sub(repl, text)

    def meta(self, val: Any) -> Any:
        """Tensor metadata of a node result (fake tensor, SymInt, tuples of them)."""
        if isinstance(val, torch.Tensor):
            return {
                "shape": [self.dim(d) for d in val.shape],
                "stride": [self.dim(d) for d in val.stride()] if val.layout == torch.strided else None,
                "dtype": str(val.dtype),
                "device": val.device.type,
                "layout": str(val.layout),
            }
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ["sym", self.sym(str(val))]
        if isinstance(val, (list, tuple)):
            return [self.meta(v) for v in val]
        if val is None or isinstance(val, (bool, int, str)):
            return val
        if isinstance(val, float):
            return ["f", repr(val)]
        return ["type", _qualname(type(val))]

    def dim(self, d: Any) -> Any:
        return int(d) if isinstance(d, int) else self.sym(str(d))

    def arg(self, a: Any) -> Any:
        """Canonical form of a node argument; literal values are kept exactly."""
        if isinstance(a, torch.fx.Node):
            return ["node", self.node_index[a]]
        if a is None or isinstance(a, str):
            return a
        if isinstance(a, bool):
            return ["b", a]
        if isinstance(a, int):
            return ["i", a]
        if isinstance(a, float):
            return ["f", repr(a)]
        if isinstance(a, complex):
            return ["c", repr(a)]
        if isinstance(a, (list, tuple)):
            return [type(a).__name__, [self.arg(x) for x in a]]
        if isinstance(a, Mapping):
            return ["dict", sorted([str(k), self.arg(v)] for k, v in a.items())]
        if isinstance(a, slice):
            return ["slice", self.arg(a.start), self.arg(a.stop), self.arg(a.step)]
        if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return ["torch", str(a)]
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ["sym", self.sym(str(a))]
        if isinstance(a, torch.Tensor):
            if _is_fake(a):
                return ["tensor", self.meta(a)]
            return ["tensor", self.meta(a), tensor_digest(a)]
        if isinstance(a, enum.Enum):
            return ["enum", _qualname(type(a)), a.name]
        if a is Ellipsis:
            return ["ellipsis"]
        if isinstance(a, (types.FunctionType, functools.partial)):  # a Python function: by its code, too
            return ["fn", _target_name(a), code_fingerprint([a])]
        if callable(a):
            return ["fn", _target_name(a)]
        # Unknown objects: type plus repr. A repr that embeds an address makes the
        # hash unstable, which costs a miss, never a wrong hit.
        return ["obj", _qualname(type(a)), repr(a)]


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor

        return isinstance(t, FakeTensor) or t.device.type == "meta"
    except ImportError:  # pragma: no cover - torch always has it
        return t.device.type == "meta"


def _qualname(obj: Any) -> str:
    mod = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{mod}.{name}" if mod else str(name)


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop.{target.name()}"
    return _qualname(target)


def _input_descriptors(program: Any) -> dict[str, Any]:
    """Placeholder name -> what it stands for (user input index, weight name, constant)."""
    out: dict[str, Any] = {}
    if isinstance(program, torch.export.ExportedProgram):
        user = 0
        for spec in program.graph_signature.input_specs:
            name = getattr(spec.arg, "name", None)
            if name is None:
                continue
            kind = spec.kind.name
            if kind == "USER_INPUT":
                out[name] = ["user", user]
                user += 1
            elif kind == "CONSTANT_TENSOR":
                value = program.constants.get(spec.target)
                digest = tensor_digest(value) if isinstance(value, torch.Tensor) else _qualname(type(value))
                out[name] = ["constant", spec.target, digest]
            else:
                out[name] = [kind.lower(), spec.target, bool(spec.persistent) if spec.persistent is not None else None]
    return out


def _graph_payload(gm: torch.fx.GraphModule, descriptors: Mapping[str, Any], canon: _Canon) -> list[Any]:
    nodes: list[Any] = []
    user = 0
    for i, node in enumerate(gm.graph.nodes):
        canon.node_index[node] = i
        meta = canon.meta(node.meta.get("val", node.meta.get("tensor_meta")))
        if node.op == "placeholder":
            desc = descriptors.get(node.name)
            if desc is None:  # plain GraphModule: placeholders are user inputs in order
                desc = ["user", user]
                user += 1
            nodes.append(["placeholder", desc, meta])
            continue
        if node.op == "get_attr":
            attr = _get_attr(gm, str(node.target))
            if isinstance(attr, torch.fx.GraphModule):
                sub = _Canon()
                sub.symbols = canon.symbols
                body = _graph_payload(attr, {}, sub)
                nodes.append(["get_attr", "graph", json_digest(body)])
            elif isinstance(attr, torch.Tensor):
                # A weight of a plain GraphModule: by name and metadata, never by value.
                nodes.append(["get_attr", str(node.target), canon.meta(attr)])
            else:
                nodes.append(["get_attr", str(node.target), _qualname(type(attr))])
            continue
        target: Any = _target_name(node.target)
        if node.op == "call_module":
            sub_mod = _get_attr(gm, str(node.target))
            extra = sub_mod.extra_repr() if isinstance(sub_mod, torch.nn.Module) else ""
            target = [str(node.target), _qualname(type(sub_mod)), extra]
        nodes.append([node.op, target, canon.arg(tuple(node.args)), canon.arg(dict(node.kwargs)), meta])
    return nodes


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def graph_fingerprint(program: Any) -> dict[str, Any]:
    """Structural fingerprint of an ExportedProgram or GraphModule (no weight values)."""
    if isinstance(program, torch.export.ExportedProgram):
        gm = program.graph_module
    elif isinstance(program, torch.fx.GraphModule):
        gm = program
    else:
        raise CacheKeyError(f"cannot fingerprint {type(program).__name__}: expected ExportedProgram or GraphModule")
    canon = _Canon()
    nodes = _graph_payload(gm, _input_descriptors(program), canon)
    out: dict[str, Any] = {"nodes": json_digest(nodes), "num_nodes": len(nodes)}
    if isinstance(program, torch.export.ExportedProgram):
        out["outputs"] = [
            [s.kind.name, s.target if s.kind.name != "USER_OUTPUT" else None]
            for s in program.graph_signature.output_specs
        ]
        ranges = []
        for sym, vr in program.range_constraints.items():
            ranges.append([canon.sym(str(sym)), str(vr.lower), str(vr.upper)])
        out["ranges"] = sorted(ranges)
        out["call_spec"] = call_spec(program)
    return out


def call_spec(program: torch.export.ExportedProgram) -> list[str | None]:
    spec = program.call_spec
    return [
        pytree.treespec_dumps(spec.in_spec) if spec.in_spec is not None else None,
        pytree.treespec_dumps(spec.out_spec) if spec.out_spec is not None else None,
    ]


# --------------------------------------------------------------------------- inputs


def _dim_spec(d: Any, names: dict[str, str]) -> Any:
    if d is None or isinstance(d, (bool, int, str)):
        return d
    name = getattr(d, "__name__", None)
    if name is not None and hasattr(d, "min") and hasattr(d, "max"):
        if name not in names:
            names[name] = f"d{len(names)}"
        root = getattr(d, "root", None)
        fn = getattr(d, "fn", None)
        derived = None
        if root is not None and fn is not None:
            derived = [_dim_spec(root, names), repr(fn(7)), repr(fn(11))]
        return ["dim", names[name], int(d.min), int(d.max), derived]
    return ["obj", _qualname(type(d)), repr(d)]


def input_specs(example_inputs: Any, dynamic_shapes: Any = None, *, shapes: bool = True) -> dict[str, Any]:
    """Pytree structure, dtypes and (unless ``shapes=False``) sizes of the example inputs.

    For an ExportedProgram the sizes come from the graph (where dynamic dimensions
    are symbols), so the example sizes are left out: an engine with a dynamic batch
    serves every batch size in its range.
    """
    if example_inputs is None:
        example_inputs = ()
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    leaves, spec = pytree.tree_flatten(example_inputs)
    rendered: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            item: dict[str, Any] = {"dtype": str(leaf.dtype), "ndim": leaf.dim(), "device": leaf.device.type}
            if shapes:
                item["shape"] = list(leaf.shape)
            rendered.append(item)
        else:
            rendered.append(_Canon().arg(leaf))
    names: dict[str, str] = {}
    dyn = None
    if dynamic_shapes is not None:
        dyn_leaves, dyn_spec = pytree.tree_flatten(
            dynamic_shapes, is_leaf=lambda x: x is None or not isinstance(x, (list, tuple, dict))
        )
        dyn = [str(dyn_spec), [_dim_spec(d, names) for d in dyn_leaves]]
    return {"structure": str(spec), "leaves": rendered, "dynamic_shapes": dyn}


# --------------------------------------------------------------------------- hash


def hash_components(
    program: Any, example_inputs: Any = (), *, settings: Mapping[str, Any] | None = None, dynamic_shapes: Any = None
) -> dict[str, Any]:
    """The named, JSON-safe components of an engine hash (stored for ``adstore explain``)."""
    if isinstance(program, torch.nn.Module) and not isinstance(program, torch.fx.GraphModule):
        program = torch.export.export(program, as_tuple(example_inputs), dynamic_shapes=dynamic_shapes)
    is_ep = isinstance(program, torch.export.ExportedProgram)
    try:
        graph = graph_fingerprint(program)
        inputs = input_specs(example_inputs, dynamic_shapes, shapes=not is_ep)
    except (CacheKeyError, ConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 - an unhashable graph is a bypass, with its reason
        raise CacheKeyError(f"cannot hash graph: {type(exc).__name__}: {exc}") from exc
    return {
        "version": HASH_VERSION,
        "graph": graph,
        "inputs": inputs,
        "settings": codegen_settings(settings),
        "toolchain": toolchain_identity(),
    }


def as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    """Example inputs as the tuple ``torch.export`` takes (a single input becomes a 1-tuple)."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def get_hash(
    program: Any, example_inputs: Any = (), *, settings: Mapping[str, Any] | None = None, dynamic_shapes: Any = None
) -> str:
    """SHA-256 hex of the engine's architecture (see module docstring); never mutates weights."""
    return json_digest(hash_components(program, example_inputs, settings=settings, dynamic_shapes=dynamic_shapes))
