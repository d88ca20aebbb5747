"""Encode one GraphModule's graph and GraphModule-only state; rebuild it without exec of payload text.

What is written per GraphModule: the node list in order (name, op, target,
args, kwargs, type, plain meta, ``meta["val"]`` as tensor specs), the codegen
state (plain or pytree, with the in/out ``TreeSpec`` as pytree JSON), the
GraphModule class (from a small table: ``GraphModule`` and export's
``_StatefulGraphModule``), its instance-bound methods, ``range_constraints``
and export's standard forward hooks and guard module, which are recognised
and recreated rather than pickled.

The one thing a restore executes is the code FX generates from the rebuilt
graph (``recompile``).  Every string that reaches that generated source is
validated first: node names and placeholder/arg names must be identifiers,
attribute paths dotted identifiers without dunders, call targets resolved
objects under the allow-list.  Constants appear only through ``repr`` of
decoded JSON values.
"""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo
from torch.fx.passes.shape_prop import TensorMetadata
from torch.utils import _pytree as pytree

from adstore.integration.errors import CorruptSnapshot, UnsupportedModule, UntrustedTarget
from adstore.integration.snapshot.export import (
    STATEFUL_GM,
    LazyGraphModule,
    RestoredExportModule,
    RestoredGuards,
    bind_method,
    check_export_inputs,
    export_forward_hooks,
)
from adstore.integration.snapshot.names import (
    attr_path,
    check_attribute_access,
    check_pytree_types,
    identifier,
    placeholder_target,
)
from adstore.integration.snapshot.opmodules import op_modules
from adstore.integration.snapshot.targets import qualname_of, resolve_target
from adstore.integration.snapshot.values import MEMORY_FORMATS, Unencodable, ValueDecoder, ValueEncoder
from adstore.integration.snapshot.wire import pack_node, unpack_node

__all__ = [
    "GM_CLASSES",
    "GM_KEYS",
    "STALE_SHAPE_KEY",
    "GraphDecoder",
    "MetaTable",
    "encode_graph_module",
    "is_shape_stale",
    "real_class",
]

logger = logging.getLogger(__name__)

#: ``node.meta`` key set to True on weight (parameter) ``get_attr`` nodes after a restore:
#: their shape metadata predates weight loading/sharding and must not be trusted.
STALE_SHAPE_KEY = "adstore_stale_shape"

_SKIP_META = frozenset({"from_node", "unbacked_bindings", "tensor_meta", "example_value", STALE_SHAPE_KEY})
_SPEC_META = frozenset({"val"})
_MISSING = object()
_DROPPED = object()
#: GraphModule classes a snapshot may name, and therefore rebuild.
GM_CLASSES = ("torch.fx.graph_module.GraphModule", STATEFUL_GM)
#: GraphModule instance attributes handled here (everything else goes to generic attrs).
GM_KEYS = frozenset(
    {
        "_graph",
        "_code",
        "_lineno_map",
        "_prologue_start",
        "_tracer_cls",
        "_tracer_extras",
        "meta",
        "_replace_hooks",
        "_create_node_hooks",
        "_erase_node_hooks",
        "_deepcopy_hooks",
        "_in_spec",
        "_out_spec",
        "shape_env",
        "range_constraints",
        "validate_inputs",
    }
)


def is_shape_stale(node: torch.fx.Node) -> bool:
    """True when ``node`` is a weight node whose shape metadata came from a snapshot."""
    return bool(node.meta.get(STALE_SHAPE_KEY, False))


def real_class(module: torch.nn.Module) -> type:
    cls = type(module)
    if isinstance(module, torch.fx.GraphModule):
        for c in cls.__mro__:
            if "<locals>" not in c.__qualname__:
                return c
    return cls


def _real_class_name(module: torch.nn.Module) -> str | None:
    cls = real_class(module)
    if issubclass(cls, RestoredExportModule):
        return STATEFUL_GM
    return GM_CLASSES[0] if cls is LazyGraphModule else qualname_of(cls)


# ----------------------------------------------------------------------------- encode
class MetaTable:
    """Interns plain node-meta values: each distinct value is written and decoded once.

    Transformer graphs repeat the same ``stack_trace`` / ``nn_module_stack`` /
    ``torch_fn`` values layer after layer, so interning shrinks the payload and
    lets restore decode each value once (nodes get their own shallow copy of
    mutable containers).
    """

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._index: dict[str, int] = {}

    def add(self, encoded: Any) -> int:
        key = json.dumps(encoded, separators=(",", ":"))
        idx = self._index.get(key)
        if idx is None:
            idx = self._index[key] = len(self.values)
            self.values.append(encoded)
        return idx


def _encode_meta(meta: dict[str, Any], enc: ValueEncoder, plain: ValueEncoder, table: MetaTable) -> dict[str, Any]:
    """``val`` inline as tensor specs; every other plain value interned (``plain`` refuses node refs,
    so an interned value never depends on the graph it came from)."""
    out: dict[str, Any] = {}
    for k, v in meta.items():
        if k in _SKIP_META or not isinstance(k, str):
            continue
        try:
            if k in _SPEC_META:
                out[k] = enc.encode(v, specs=True)
            else:
                out[k] = table.add(plain.encode(v, specs=None))
        except Unencodable as exc:
            if k in _SPEC_META:
                raise
            logger.debug("dropping node meta %r: %s", k, exc)
    tm = meta.get("tensor_meta")
    if isinstance(tm, TensorMetadata) and not tm.is_quantized:
        # Only the memory format is not derivable cheaply from ``val``; the rest is rebuilt from it.
        # (``requires_grad`` is recorded too: export computes it under a different grad mode than ``val``.)
        out["tensor_meta"] = [
            "tm",
            None if tm.memory_format is None else str(tm.memory_format).removeprefix("torch."),
            bool(tm.requires_grad),
        ]
    return out


def _encode_codegen(graph: torch.fx.Graph) -> dict[str, Any]:
    cg = graph._codegen
    if getattr(cg, "_body_transformer", None) is not None:
        raise UnsupportedModule("graph codegen has a body transformer, which snapshots do not encode")
    if type(cg) is CodeGen:
        return {"kind": "plain"}
    if type(cg) is _PyTreeCodeGen:
        info = cg.pytree_info
        try:
            specs = [None if s is None else pytree.treespec_dumps(s) for s in (info.in_spec, info.out_spec)]
        except Exception as exc:  # torch raises NotImplementedError/TypeError for unregistered types
            raise UnsupportedModule(f"pytree spec is not serializable: {exc}") from exc
        return {"kind": "pytree", "orig_args": list(info.orig_args), "in_spec": specs[0], "out_spec": specs[1]}
    raise UnsupportedModule(f"graph codegen {type(cg).__qualname__} is not supported")


def encode_graph_module(gm: torch.fx.GraphModule, enc: ValueEncoder, path: str, table: MetaTable) -> dict[str, Any]:
    """Encode the graph and GraphModule-only state of ``gm`` (submodules/params are the tree's job)."""
    cls_name = _real_class_name(gm)
    if cls_name not in GM_CLASSES:
        raise UnsupportedModule(f"{path or '<root>'}: GraphModule subclass {cls_name or type(gm)} is not supported")
    graph = gm.graph
    node_index: dict[torch.fx.Node, int] = {}
    enc.node_index = node_index
    targets: list[str] = []
    tindex: dict[str, int] = {}
    nodes = []
    stale: list[str] = []
    params = dict(gm.named_parameters(remove_duplicate=False))
    plain = ValueEncoder(node_index={}, tensors=enc.tensors, symbols=enc.symbols)
    for i, n in enumerate(graph.nodes):
        if n.op == "call_function":
            q = qualname_of(n.target)
            if q is None:
                raise UnsupportedModule(f"{path or '<root>'}: node {n.name!r} target {n.target!r} is not importable")
            target: Any = tindex.get(q)
            if target is None:
                target = tindex[q] = len(targets)
                targets.append(q)
        elif isinstance(n.target, str):
            target = n.target
        else:
            raise UnsupportedModule(f"{path or '<root>'}: node {n.name!r} has non-string target for op {n.op}")
        try:
            args = enc.encode(n.args)
            kwargs = enc.encode(n.kwargs)
            type_enc = None
            if n.type is not None:
                q = qualname_of(n.type)
                if q is None:
                    raise Unencodable(f"type annotation {n.type!r} is not importable")
                type_enc = q
            meta = _encode_meta(n.meta, enc, plain, table)
        except Unencodable as exc:
            raise UnsupportedModule(f"{path or '<root>'}: node {n.name!r}: {exc}") from exc
        if n.op == "get_attr" and n.target in params:
            stale.append(n.name)
        nodes.append(pack_node(n.name, n.op, target, args, kwargs, type_enc, meta))
        node_index[n] = i
    enc.node_index = {}
    out: dict[str, Any] = {
        "gm_class": cls_name,
        "class_name": type(gm).__name__,
        "op_modules": op_modules(graph),
        "targets": targets,
        "nodes": nodes,
        "codegen": _encode_codegen(graph),
        "weight_nodes": stale,
    }
    gm_meta = {}
    for k, v in getattr(gm, "meta", {}).items():
        try:
            gm_meta[k] = enc.encode(v, specs=None)
        except Unencodable:
            logger.debug("dropping GraphModule meta %r", k)
    out["meta"] = gm_meta
    rc = gm.__dict__.get("range_constraints")
    if isinstance(rc, dict):
        out["range_constraints"] = enc.symbols.add_ranges(rc)
    elif rc is not None and rc != []:
        raise UnsupportedModule(f"{path or '<root>'}: unsupported range_constraints {type(rc)}")
    if "validate_inputs" in gm.__dict__:
        out["validate_inputs"] = bool(gm.validate_inputs)
    if gm.__dict__.get("shape_env") is not None:
        out["shape_env"] = True
    tracer = gm.__dict__.get("_tracer_cls")
    out["tracer_cls"] = qualname_of(tracer) if tracer is not None else None
    try:
        out["tracer_extras"] = enc.encode(gm.__dict__.get("_tracer_extras") or {}, specs=None)
    except Unencodable:
        out["tracer_extras"] = None
    for hooks_name in ("_replace_hooks", "_create_node_hooks", "_erase_node_hooks", "_deepcopy_hooks"):
        if gm.__dict__.get(hooks_name):
            raise UnsupportedModule(f"{path or '<root>'}: GraphModule has {hooks_name}")
    out["export_hooks"] = bool(export_forward_hooks(gm))
    return out


# ----------------------------------------------------------------------------- decode
class GraphDecoder:
    """Rebuilds graphs of one snapshot; shares the symbol/fake-tensor context between graphs."""

    def __init__(
        self,
        *,
        tensors: Sequence[torch.Tensor],
        syms: Any,
        extra_prefixes: Sequence[str],
        meta_table: Sequence[Any] = (),
    ) -> None:
        self.tensors = tensors
        self.meta_table = meta_table
        self._meta_cache: dict[int, Any] = {}
        self.syms = syms  # tensor_meta.SymDecoder
        self.extra = tuple(extra_prefixes)
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        from adstore.integration.snapshot.tensor_meta import DTYPES

        self._extract_tensor_metadata = _extract_tensor_metadata
        self._fake_cls = FakeTensor
        self._dtypes = DTYPES
        self._devices: dict[str, torch.device] = {}

    def _spec(self, e: list[Any]) -> torch.Tensor:
        """A FakeTensor for a spec, built directly around a meta tensor.

        Wrapping a meta tensor is ~15x cheaper than dispatching ``empty_strided``
        through ``FakeTensorMode`` and gives the same FakeTensor (same mode, shape,
        stride, dtype, device).
        """
        try:
            _, shape, stride, offset, dtype, device, grad = e
        except (TypeError, ValueError):
            raise CorruptSnapshot("bad tensor spec") from None
        d = self._values.decode
        shape = [s if type(s) is int else d(s) for s in shape]
        stride = [s if type(s) is int else d(s) for s in stride]
        dt = self._dtypes.get(dtype)
        if dt is None:
            raise CorruptSnapshot(f"unknown dtype {dtype!r}")
        dev = self._devices.get(device)
        if dev is None:
            dev = self._devices[device] = torch.device(device)
        elem = torch.empty_strided(shape, stride, dtype=dt, device="meta")
        if offset != 0:  # a symbolic offset is never tested for truth (an unbacked one cannot be)
            elem = elem.as_strided(shape, stride, offset if type(offset) is int else d(offset))
        t = self._fake_cls(self.syms.fake_mode, elem, dev)
        if grad:
            t.requires_grad_(True)
        return t

    def codegen(self, enc: dict[str, Any]) -> CodeGen:
        kind = enc.get("kind")
        if kind == "plain":
            return CodeGen()
        if kind != "pytree":
            raise CorruptSnapshot(f"unknown codegen kind {kind!r}")
        args = [identifier(a, "argument name") for a in enc["orig_args"]]
        specs = []
        for s in (enc.get("in_spec"), enc.get("out_spec")):
            if s is None:
                specs.append(None)
                continue
            check_pytree_types(s, self.extra)
            try:
                specs.append(pytree.treespec_loads(s))
            except Exception as exc:  # unknown type names etc.
                raise CorruptSnapshot(f"pytree spec does not load: {exc}") from exc
        return _PyTreeCodeGen(_PyTreeInfo(args, specs[0], specs[1]))

    def graph(self, enc: dict[str, Any]) -> torch.fx.Graph:
        for mod in enc.get("op_modules", ()):
            # an allow-listed module that registers custom ops (resolving it imports it)
            if not isinstance(resolve_target(mod, self.extra), types.ModuleType):
                raise UntrustedTarget(str(mod))
        targets = [resolve_target(q, self.extra) for q in enc["targets"]]
        for t in targets:
            if not callable(t):
                raise UntrustedTarget(repr(t))
        graph = torch.fx.Graph()
        nodes: list[torch.fx.Node] = []
        self._values = values = ValueDecoder(
            nodes=nodes, tensors=self.tensors, sym=self.syms.sym, spec=self._spec, extra_prefixes=self.extra
        )
        decode = values.decode
        create = graph.create_node
        ntargets = len(targets)
        cache = self._meta_cache
        for rec in enc["nodes"]:
            name, op, target, a, k, ty, meta = unpack_node(rec)
            if op == "call_function":
                if type(target) is not int or not 0 <= target < ntargets:
                    raise CorruptSnapshot(f"node {name!r}: bad target index")
                target = targets[target]
            elif op == "placeholder":
                target = placeholder_target(target)
            elif op == "output":
                if target != "output":
                    raise CorruptSnapshot("output node target must be 'output'")
            elif op in ("get_attr", "call_module", "call_method"):
                target = attr_path(target, op)
            else:
                raise CorruptSnapshot(f"unknown node op {op!r}")
            identifier(name, "node name")
            args = decode(a)
            kwargs = decode(k)
            if type(args) is not tuple or type(kwargs) is not dict:
                raise CorruptSnapshot(f"node {name!r}: args/kwargs have the wrong type")
            if op in ("call_function", "call_method"):
                check_attribute_access(name, target, args, kwargs)
            type_expr = resolve_target(ty, self.extra) if ty is not None else None
            node = create(op, target, args, kwargs, name=name, type_expr=type_expr)
            if node.name != name:
                raise CorruptSnapshot(f"duplicate node name {name!r}")
            if meta:
                m = node.meta
                for key, v in meta.items():
                    if key == "tensor_meta":
                        continue
                    if key in _SPEC_META:
                        m[key] = decode(v)
                        continue
                    if type(v) is not int:
                        raise CorruptSnapshot(f"node {name!r}: meta {key!r} is not a meta-table index")
                    hit = cache.get(v, _MISSING)
                    if hit is _MISSING:
                        hit = cache[v] = self._table_value(v)
                    if hit is _DROPPED:
                        logger.debug("node %s: dropping meta %r naming an untrusted callable", name, key)
                        continue
                    tv = type(hit)
                    m[key] = hit.copy() if tv is dict or tv is list else hit
                tm = meta.get("tensor_meta")
                if tm is not None:
                    val = m.get("val")
                    if isinstance(val, torch.Tensor):
                        m["tensor_meta"] = self._tensor_meta(val, tm)
            nodes.append(node)
        graph._codegen = self.codegen(enc["codegen"])
        weight_nodes = set(enc.get("weight_nodes", ()))
        if weight_nodes:
            for node in graph.find_nodes(op="get_attr"):
                if node.name in weight_nodes:
                    node.meta[STALE_SHAPE_KEY] = True
        return graph

    def _tensor_meta(self, val: torch.Tensor, enc: Any) -> TensorMetadata:
        """``TensorMetadata`` from the restored ``val`` and the recorded memory format
        (what ``_extract_tensor_metadata`` returns, without its contiguity probing)."""
        if type(enc) is list and len(enc) == 3 and enc[0] == "tm":
            mf = None
            if enc[1] is not None:
                mf = MEMORY_FORMATS.get(enc[1])
                if mf is None:
                    raise CorruptSnapshot(f"unknown memory format {enc[1]!r}")
            return TensorMetadata(val.shape, val.dtype, bool(enc[2]), val.stride(), mf, False, {})
        return self._extract_tensor_metadata(val)

    def _table_value(self, idx: Any) -> Any:
        if type(idx) is not int or not 0 <= idx < len(self.meta_table):
            raise CorruptSnapshot(f"meta table index {idx!r} out of range")
        try:
            return self._values.decode(self.meta_table[idx])
        except UntrustedTarget:
            return _DROPPED

    def plain(self, e: Any) -> Any:
        return ValueDecoder(tensors=self.tensors, sym=self.syms.sym, extra_prefixes=self.extra).decode(e)

    def make_module(self, enc: dict[str, Any]) -> torch.fx.GraphModule:
        """An empty GraphModule of the recorded class; the caller fills it and sets ``.graph``."""
        cls_name = enc.get("gm_class")
        class_name = identifier(enc.get("class_name", "GraphModule"), "class name")
        if cls_name == GM_CLASSES[0]:
            gm = LazyGraphModule(torch.nn.Module(), torch.fx.Graph(), class_name)
        elif cls_name == STATEFUL_GM:
            rc = self.syms.range_constraints(enc.get("range_constraints") or [])
            gm = RestoredExportModule(torch.nn.Module(), torch.fx.Graph(), range_constraints=rc)
            type(gm).__name__ = class_name
            if "validate_inputs" in enc:
                gm.validate_inputs = bool(enc["validate_inputs"])
        else:
            raise UntrustedTarget(str(cls_name))
        return gm

    def finish(
        self, gm: torch.fx.GraphModule, enc: dict[str, Any], graph: torch.fx.Graph, methods: list[list[str]]
    ) -> None:
        """Attach the graph (its code is generated when first needed) and the GraphModule-only state."""
        gm.graph = graph
        gm.meta.update(self.plain(["d", *sum(([k, v] for k, v in enc.get("meta", {}).items()), [])]))
        if enc.get("shape_env"):
            gm.shape_env = self.syms.shape_env
        if enc.get("tracer_cls"):
            try:
                gm._tracer_cls = resolve_target(enc["tracer_cls"], self.extra)
            except UntrustedTarget:
                gm._tracer_cls = None
        if enc.get("tracer_extras") is not None:
            gm._tracer_extras = self.plain(enc["tracer_extras"])
        if enc.get("export_hooks"):
            gm.register_forward_pre_hook(check_export_inputs, with_kwargs=True)
        guards = gm._modules.get("_guards_fn")
        if isinstance(guards, RestoredGuards):
            guards.bind(gm)
        for name, kind, q in methods:
            bind_method(gm, name, kind, q, self.extra)
