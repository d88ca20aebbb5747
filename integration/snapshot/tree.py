"""The submodule tree of a snapshot: classes, parameters as specs, real buffers, plain attributes.

Every module in the tree is written as its class qualname, ``training`` flag,
parameters (shape/stride/dtype/``requires_grad`` only: the module is saved
before weights are loaded, so parameters must live on the ``meta`` device),
buffers (real values, into the payload's tensor list), plain attributes
(structurally encoded; tensors that are not registered go to the tensor list)
and children.  GraphModules additionally carry their graph
(:mod:`adstore.integration.snapshot.graph`).  Shared parameters, buffers and
modules are written once and referenced by path, so ties survive a restore.

Rebuilding a plain module never runs its class's ``__init__``: the object is
allocated with ``object.__new__`` and filled in directly, and the class itself
must resolve under the allow-list.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from adstore.integration.errors import (
    CorruptSnapshot,
    ForwardHookPresent,
    MaterializedParameters,
    UnsupportedHook,
    UnsupportedModule,
    UntrustedTarget,
)
from adstore.integration.snapshot.export import RestoredGuards, encode_bound_method, export_forward_hooks
from adstore.integration.snapshot.graph import GM_KEYS, GraphDecoder, MetaTable, encode_graph_module, real_class
from adstore.integration.snapshot.names import identifier, member_name
from adstore.integration.snapshot.targets import qualname_of, resolve_target
from adstore.integration.snapshot.tensor_meta import DTYPES, dtype_name
from adstore.integration.snapshot.values import Unencodable, ValueEncoder
from adstore.integration.snapshot.wire import (
    alias_of,
    alias_ref,
    module_alias,
    module_alias_of,
    pack_param,
    unpack_param,
)

__all__ = ["TreeEncoder", "TreeDecoder", "MODULE_KEYS"]

logger = logging.getLogger(__name__)

#: Instance attributes every ``nn.Module`` has; handled structurally, never as plain attrs.
MODULE_KEYS = frozenset(torch.nn.Module().__dict__) | {"_compiled_call_impl"}
_OTHER_HOOK_DICTS = ("_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks")
_GUARDS_CLASS = "torch.export._unlift.GuardsFn"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class TreeEncoder:
    """Save side of the module tree (one instance per snapshot)."""

    def __init__(self) -> None:
        self.values = ValueEncoder()
        self._modules: dict[int, str] = {}
        self._params: dict[int, str] = {}
        self._buffers: dict[int, str] = {}
        self.materialized: list[str] = []
        self.graph_count = 0
        self.meta_table = MetaTable()

    def encode(self, root: torch.nn.Module) -> dict[str, Any]:
        if not isinstance(root, torch.nn.Module):
            raise UnsupportedModule(f"cannot snapshot a {type(root).__qualname__}: not a torch.nn.Module")
        tree = self.module(root, "")
        if self.materialized:
            raise MaterializedParameters(self.materialized)
        return tree

    def _check_hooks(self, m: torch.nn.Module, path: str) -> bool:
        export_hooks = export_forward_hooks(m)
        if export_hooks is False:
            raise ForwardHookPresent(f"{path or '<root>'} has forward hooks or forward pre-hooks", detail=path)
        for name in _OTHER_HOOK_DICTS:
            hooks = getattr(m, name, None)
            if hooks:
                raise UnsupportedHook(
                    f"{path or '<root>'} has {name.strip('_').replace('_', ' ')}: {list(hooks.values())[0]!r}",
                    detail=path,
                )
        return bool(export_hooks)

    def module(self, m: torch.nn.Module, path: str) -> dict[str, Any]:
        seen = self._modules.get(id(m))
        if seen is not None:
            return module_alias(seen)
        self._modules[id(m)] = path
        self._check_hooks(m, path)
        cls = real_class(m)
        q = qualname_of(cls)
        where = path or "<root>"
        if q is None:
            raise UnsupportedModule(f"{where}: module class {cls!r} is not importable")
        node: dict[str, Any] = {"class": q, "training": bool(m.training)}
        if q == _GUARDS_CLASS or isinstance(m, RestoredGuards):
            node["kind"] = "guards"
            return node
        if not isinstance(m, torch.fx.GraphModule) and cls.__new__ is not object.__new__:
            raise UnsupportedModule(f"{where}: module class {q} overrides __new__")
        params = []
        for name, p in m._parameters.items():
            full = _join(path, name)
            if p is None:
                params.append([name, None])
                continue
            if id(p) in self._params:
                params.append([name, alias_ref(self._params[id(p)])])
                continue
            if type(p) is not torch.nn.Parameter:
                raise UnsupportedModule(f"{full}: parameter type {type(p).__qualname__} is not supported")
            self._params[id(p)] = full
            if p.device.type != "meta":
                self.materialized.append(full)
            spec = pack_param(list(p.shape), list(p.stride()), dtype_name(p.dtype), bool(p.requires_grad))
            params.append([name, spec])
        buffers = []
        for name, b in m._buffers.items():
            persistent = name not in m._non_persistent_buffers_set
            if b is None:
                buffers.append([name, None, persistent])
            elif id(b) in self._buffers:
                buffers.append([name, alias_ref(self._buffers[id(b)]), persistent])
            else:
                self._buffers[id(b)] = _join(path, name)
                buffers.append([name, self.values.tensor_ref(b.detach()), persistent])
        node["params"] = params
        node["buffers"] = buffers
        is_gm = isinstance(m, torch.fx.GraphModule)
        attrs: dict[str, Any] = {}
        methods: list[list[str]] = []
        for k, v in m.__dict__.items():
            if k in MODULE_KEYS or (is_gm and k in GM_KEYS):
                continue
            if isinstance(v, types.MethodType):
                if not is_gm:
                    raise UnsupportedModule(f"{where}: attribute {k!r} is a bound method")
                methods.append(encode_bound_method(m, k, v, path))
                continue
            try:
                attrs[k] = self.values.encode(v, specs=False)
            except Unencodable as exc:
                raise UnsupportedModule(f"{where}: attribute {k!r}: {exc}") from exc
        node["attrs"] = attrs
        node["children"] = [
            [name, None if c is None else self.module(c, _join(path, name))] for name, c in m._modules.items()
        ]
        if is_gm:
            self.graph_count += 1
            node["graph"] = encode_graph_module(m, self.values, path, self.meta_table)
            node["methods"] = methods
        return node


class TreeDecoder:
    """Load side of the module tree; resolves every class under the allow-list."""

    def __init__(
        self,
        *,
        tensors: Sequence[torch.Tensor],
        syms: Any,
        extra_prefixes: Sequence[str],
        meta_table: Sequence[Any] = (),
    ) -> None:
        self.tensors = tensors
        self.extra = tuple(extra_prefixes)
        self.graphs = GraphDecoder(tensors=tensors, syms=syms, extra_prefixes=self.extra, meta_table=meta_table)
        self._modules: dict[str, torch.nn.Module] = {}
        self._params: dict[str, torch.nn.Parameter] = {}
        self._buffers: dict[str, torch.Tensor] = {}

    def _tensor(self, ref: Any) -> torch.Tensor:
        if not (
            isinstance(ref, list)
            and len(ref) == 2
            and ref[0] == "T"
            and type(ref[1]) is int
            and 0 <= ref[1] < len(self.tensors)
        ):
            raise CorruptSnapshot(f"bad tensor reference {ref!r}")
        return self.tensors[ref[1]]

    def _alias(self, table: dict[str, Any], ref: Any) -> Any:
        path = alias_of(ref)
        return None if path is None else table.get(path)

    def _param(self, spec: Any, full: str) -> torch.nn.Parameter:
        hit = self._alias(self._params, spec)
        if hit is not None:
            return hit
        try:
            shape, stride, dtype, grad = unpack_param(spec)
            data = torch.empty_strided(shape, stride, dtype=DTYPES[dtype], device="meta")
        except (CorruptSnapshot, KeyError, TypeError, ValueError, RuntimeError):
            raise CorruptSnapshot(f"bad parameter spec for {full}") from None
        p = torch.nn.Parameter(data, requires_grad=bool(grad))
        self._params[full] = p
        return p

    def module(self, enc: Any, path: str) -> torch.nn.Module:
        if not isinstance(enc, dict):
            raise CorruptSnapshot(f"bad module record at {path or '<root>'}")
        alias = module_alias_of(enc)
        if alias is not None:
            hit = self._modules.get(alias)
            if hit is None:
                raise CorruptSnapshot(f"module alias {alias!r} names no earlier module")
            return hit
        q = enc.get("class")
        if enc.get("kind") == "guards":
            m: torch.nn.Module = RestoredGuards()
            m.training = bool(enc.get("training", False))
            self._modules[path] = m
            return m
        is_gm = "graph" in enc
        if is_gm:
            target = self.graphs.make_module(enc["graph"])
        else:
            cls = resolve_target(q, self.extra)
            if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)) or issubclass(
                cls, torch.fx.GraphModule
            ):
                raise UntrustedTarget(str(q))
            if cls.__new__ is not object.__new__:
                raise UntrustedTarget(str(q))
            target = object.__new__(cls)
            torch.nn.Module.__init__(target)
        self._modules[path] = target
        target.training = bool(enc.get("training", True))
        for name, spec in enc.get("params", ()):
            member_name(name, "parameter name")
            target._parameters[name] = None if spec is None else self._param(spec, _join(path, name))
        for name, ref, persistent in enc.get("buffers", ()):
            member_name(name, "buffer name")
            if ref is None:
                buf = None
            else:
                buf = self._alias(self._buffers, ref)
                if buf is None:
                    buf = self._tensor(ref)
                    self._buffers[_join(path, name)] = buf
            target._buffers[name] = buf
            if not persistent:
                target._non_persistent_buffers_set.add(name)
        for name, child in enc.get("children", ()):
            member_name(name, "submodule name")
            target._modules[name] = None if child is None else self.module(child, _join(path, name))
        for k, v in enc.get("attrs", {}).items():
            identifier(k, "attribute name")
            if k in MODULE_KEYS or (is_gm and k in GM_KEYS) or (k.startswith("__") and k.endswith("__")):
                raise CorruptSnapshot(f"attribute {k!r} may not be set from a snapshot")
            target.__dict__[k] = self.graphs.plain(v)
        if is_gm:
            graph = self.graphs.graph(enc["graph"])
            self.graphs.finish(target, enc["graph"], graph, enc.get("methods", []))
        return target
