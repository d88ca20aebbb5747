"""Structural encoding of node args, kwargs and plain meta as tagged JSON.

Everything a node argument can hold is written as JSON scalars (``None``,
bools, ints, finite floats, strings) or as a list whose first element is a tag:

===========  ==============================================================
``n``        reference to an earlier node, by index in the graph
``t l d``    tuple, list, dict (dict as alternating encoded keys and values)
``sl``       slice;  ``Z`` ``torch.Size``;  ``E`` Ellipsis;  ``c`` complex
``fl``       non-finite float (``nan``, ``inf``, ``-inf``)
``dt dv``    dtype by name, device by string
``ly mf``    layout, memory format by name (looked up in fixed tables)
``sym``      SymInt/SymFloat/SymBool: expression over named symbols + hint
``T``        a real tensor, by index in the payload's tensor list
``FT``       a tensor *spec* (shape, stride, offset, dtype, device, grad)
``fn``       a callable or class by qualified name (resolved under the allow-list)
===========  ==============================================================

Because every JSON list is tagged, decoding is one dict dispatch per
container and needs no schema.  Decoding never calls anything it names:
``fn`` goes through :func:`adstore.integration.snapshot.targets.resolve_target`.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from adstore.integration.errors import CorruptSnapshot, UnsupportedModule, UntrustedTarget
from adstore.integration.snapshot.targets import qualname_of, resolve_target
from adstore.integration.snapshot.tensor_meta import DTYPES, SymbolTable, dtype_name

__all__ = ["ValueEncoder", "ValueDecoder", "Unencodable", "LAYOUTS", "MEMORY_FORMATS"]

#: Callables a payload may use as call targets but never pass around as values.
_NOT_AS_VALUES = (getattr, hasattr)

LAYOUTS: dict[str, torch.layout] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)
}
MEMORY_FORMATS: dict[str, torch.memory_format] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.memory_format)
}


class Unencodable(UnsupportedModule):
    """A value with no structural encoding (raised on save; callers name the node)."""


def _device_str(d: torch.device) -> str:
    return str(d)


class ValueEncoder:
    """Save side.  ``tensors_as_specs`` selects meta mode (fake-tensor specs) or arg mode (real tensors)."""

    def __init__(
        self,
        *,
        node_index: dict[torch.fx.Node, int] | None = None,
        tensors: list[torch.Tensor] | None = None,
        symbols: SymbolTable | None = None,
    ) -> None:
        self.node_index = node_index if node_index is not None else {}
        self.tensors = tensors if tensors is not None else []
        self.symbols = symbols if symbols is not None else SymbolTable()
        self._tensor_ids: dict[int, int] = {}

    def tensor_ref(self, t: torch.Tensor) -> list[Any]:
        idx = self._tensor_ids.get(id(t))
        if idx is None:
            idx = len(self.tensors)
            self.tensors.append(t)
            self._tensor_ids[id(t)] = idx
        return ["T", idx]

    def spec(self, t: torch.Tensor) -> list[Any]:
        if t.layout is not torch.strided or t.is_quantized or t.is_nested:
            raise Unencodable(f"tensor metadata with layout {t.layout} is not encodable")
        enc = self.encode
        return [
            "FT",
            [enc(s) for s in t.shape],
            [enc(s) for s in t.stride()],
            enc(t.storage_offset()),
            dtype_name(t.dtype),
            _device_str(t.device),
            bool(t.requires_grad),
        ]

    def encode(self, v: Any, *, specs: bool | None = False) -> Any:
        """Encode ``v``: tensors become specs (``specs=True``), references to real tensors
        (``False``), or are refused (``None``, for plain meta)."""
        tv = type(v)
        if v is None or tv is str or tv is bool or tv is int:
            return v
        if tv is float:
            return v if math.isfinite(v) else ["fl", repr(v)]
        if isinstance(v, torch.fx.Node):
            idx = self.node_index.get(v)
            if idx is None:
                raise Unencodable(f"argument refers to node {v.name!r} outside the graph or after its use")
            return ["n", idx]
        if isinstance(v, torch.Size):
            return ["Z"] + [self.encode(x) for x in v]
        if isinstance(v, tuple):
            if hasattr(v, "_fields"):
                raise Unencodable(f"named tuple {type(v).__qualname__} is not encodable")
            return ["t"] + [self.encode(x, specs=specs) for x in v]
        if isinstance(v, list):
            return ["l"] + [self.encode(x, specs=specs) for x in v]
        if isinstance(v, dict):
            out: list[Any] = ["d"]
            for k, x in v.items():
                out.append(self.encode(k))
                out.append(self.encode(x, specs=specs))
            return out
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return self.symbols.encode(v)
        if isinstance(v, torch.Tensor):
            if specs is None:
                raise Unencodable("tensor in plain metadata")
            return self.spec(v) if specs else self.tensor_ref(v)
        if isinstance(v, torch.dtype):
            return ["dt", dtype_name(v)]
        if isinstance(v, torch.device):
            return ["dv", _device_str(v)]
        if isinstance(v, torch.layout):
            return ["ly", str(v).removeprefix("torch.")]
        if isinstance(v, torch.memory_format):
            return ["mf", str(v).removeprefix("torch.")]
        if isinstance(v, slice):
            return ["sl", self.encode(v.start), self.encode(v.stop), self.encode(v.step)]
        if v is Ellipsis:
            return ["E"]
        if isinstance(v, bool):  # numpy-free subclasses of bool do not exist; kept for clarity
            return bool(v)
        if isinstance(v, int):  # int subclasses (e.g. enums) would lose their type
            raise Unencodable(f"int subclass {type(v).__qualname__} is not encodable")
        if isinstance(v, complex):
            return ["c", self.encode(v.real), self.encode(v.imag)]
        if callable(v):
            name = qualname_of(v)
            if name is None:
                raise Unencodable(f"callable {v!r} has no importable qualified name")
            return ["fn", name]
        raise Unencodable(f"value of type {type(v).__qualname__} is not encodable")


class ValueDecoder:
    """Load side: decodes what :class:`ValueEncoder` wrote, without calling anything it names."""

    def __init__(
        self,
        *,
        nodes: Sequence[torch.fx.Node] = (),
        tensors: Sequence[torch.Tensor] = (),
        sym: Callable[[list[Any]], Any] | None = None,
        spec: Callable[[list[Any]], Any] | None = None,
        extra_prefixes: Sequence[str] = (),
    ) -> None:
        self.nodes = nodes
        self.tensors = tensors
        self._sym = sym
        self._spec = spec
        self.extra_prefixes = tuple(extra_prefixes)
        d = self.decode
        self._dispatch: dict[str, Callable[[list[Any]], Any]] = {
            "n": self._node,
            "t": lambda e: tuple([d(x) for x in e[1:]]),
            "l": lambda e: [d(x) for x in e[1:]],
            "d": self._dict,
            "Z": lambda e: torch.Size([d(x) for x in e[1:]]),
            "sl": lambda e: slice(d(e[1]), d(e[2]), d(e[3])),
            "E": lambda e: Ellipsis,
            "c": lambda e: complex(d(e[1]), d(e[2])),
            "fl": self._float,
            "dt": lambda e: self._lookup(DTYPES, e, "dtype"),
            "dv": self._device,
            "ly": lambda e: self._lookup(LAYOUTS, e, "layout"),
            "mf": lambda e: self._lookup(MEMORY_FORMATS, e, "memory format"),
            "sym": self._symval,
            "T": self._tensor,
            "FT": self._fake,
            "fn": self._fn,
        }

    def _fn(self, e: list) -> object:
        """A callable named as a value; never a module or an attribute getter.

        A module as a value would give a graph ``getattr(module, name)`` access to
        everything it imports, and ``getattr`` as a value could be applied to a
        name computed at run time; both would bypass the checks on graph nodes.
        """
        obj = resolve_target(e[1], self.extra_prefixes)
        if isinstance(obj, types.ModuleType) or obj in _NOT_AS_VALUES:
            raise UntrustedTarget(str(e[1]))
        return obj

    def decode(self, e: Any) -> Any:
        te = type(e)
        if te is list:
            tag = e[0] if e else None
            # Fast paths for the two tags that make up most of a graph: node refs and tuples.
            if tag == "n" and len(e) == 2:
                i = e[1]
                if type(i) is int and 0 <= i < len(self.nodes):
                    return self.nodes[i]
                raise CorruptSnapshot(f"node reference {i!r} out of range")
            if tag == "t":
                d = self.decode
                return tuple([d(x) for x in e[1:]])
            try:
                fn = self._dispatch[tag]
            except (KeyError, TypeError):
                raise CorruptSnapshot(f"unknown value tag in {str(e)[:80]}") from None
            return fn(e)
        if e is None or te is str or te is int or te is bool or te is float:
            return e
        raise CorruptSnapshot(f"unexpected JSON value {e!r}")

    @staticmethod
    def _lookup(table: dict[str, Any], e: list[Any], what: str) -> Any:
        try:
            return table[e[1]]
        except (KeyError, IndexError, TypeError):
            raise CorruptSnapshot(f"unknown {what} {e[1:]!r}") from None

    def _node(self, e: list[Any]) -> torch.fx.Node:
        i = e[1]
        if type(i) is not int or not 0 <= i < len(self.nodes):
            raise CorruptSnapshot(f"node reference {i!r} out of range")
        return self.nodes[i]

    def _dict(self, e: list[Any]) -> dict[Any, Any]:
        if len(e) == 1:
            return {}
        d = self.decode
        items = e[1:]
        if len(items) % 2:
            raise CorruptSnapshot("dict encoding has an odd number of items")
        return {d(items[i]): d(items[i + 1]) for i in range(0, len(items), 2)}

    @staticmethod
    def _float(e: list[Any]) -> float:
        if e[1] not in ("nan", "inf", "-inf"):
            raise CorruptSnapshot(f"bad float {e[1]!r}")
        return float(e[1])

    @staticmethod
    def _device(e: list[Any]) -> torch.device:
        try:
            return torch.device(e[1])
        except (RuntimeError, TypeError, IndexError):
            raise CorruptSnapshot(f"bad device {e[1:]!r}") from None

    def _tensor(self, e: list[Any]) -> torch.Tensor:
        i = e[1]
        if type(i) is not int or not 0 <= i < len(self.tensors):
            raise CorruptSnapshot(f"tensor reference {i!r} out of range")
        return self.tensors[i]

    def _symval(self, e: list[Any]) -> Any:
        if self._sym is None:
            raise CorruptSnapshot("symbolic value where none is expected")
        return self._sym(e)

    def _fake(self, e: list[Any]) -> Any:
        if self._spec is None:
            raise CorruptSnapshot("tensor spec where none is expected")
        return self._spec(e)
