"""Tensor metadata for ``node.meta["val"]``: specs instead of fake tensors.

A fake tensor drags its ``FakeTensorMode`` and ``ShapeEnv`` along when pickled,
so the snapshot stores only what later transforms read: shape, stride, storage
offset, dtype, device and ``requires_grad``.  Dynamic dimensions stay symbolic:
every ``SymInt`` is written as a small expression tree over named symbols plus
its hint, and each symbol's assumptions, hint and value range are written once
per snapshot.  Restore recreates the symbols in one fresh ``ShapeEnv`` and the
fake tensors in one ``FakeTensorMode`` shared by every graph of the snapshot,
so ``detect_fake_mode`` and symbolic reasoning keep working after a restore.

Expression trees only name functions from a fixed table (``Add``, ``FloorDiv``
...); nothing in a payload can pick another class.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import sympy
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

from adstore.integration.errors import CorruptSnapshot, UnsupportedModule
from adstore.integration.snapshot.names import is_identifier

__all__ = ["SymbolTable", "SymDecoder", "encode_expr", "DTYPES", "dtype_name"]

logger = logging.getLogger(__name__)

# sympy and torch's symbolic-shape machinery are imported on first use: a static
# snapshot never needs them, and importing them (and building a ShapeEnv, which
# pulls in dynamo) costs most of a second on a restart.


@functools.cache
def _funcs() -> dict[str, Any]:
    """The only expression heads a payload may name."""
    import sympy
    import torch.utils._sympy.functions as symfn

    funcs: dict[str, Any] = {
        "Add": sympy.Add,
        "Mul": sympy.Mul,
        "Pow": sympy.Pow,
        "Max": symfn.Max,
        "Min": symfn.Min,
        "Eq": sympy.Eq,
        "Ne": sympy.Ne,
        "Lt": sympy.Lt,
        "Le": sympy.Le,
        "Gt": sympy.Gt,
        "Ge": sympy.Ge,
        "And": sympy.And,
        "Or": sympy.Or,
        "Not": sympy.Not,
    }
    for name in (
        "FloorDiv",
        "CleanDiv",
        "CeilDiv",
        "ModularIndexing",
        "Mod",
        "PythonMod",
        "IntTrueDiv",
        "FloatTrueDiv",
        "TruncToInt",
        "CeilToInt",
        "FloorToInt",
        "PowByNatural",
        "FloatPow",
        "ToFloat",
        "Where",
        "Identity",
        "LShift",
        "RShift",
        "RoundToInt",
        "TruncToFloat",
    ):
        if hasattr(symfn, name):
            funcs[name] = getattr(symfn, name)
    return funcs


@functools.cache
def _func_names() -> dict[Any, str]:
    return {v: k for k, v in _funcs().items()}


_ASSUMPTIONS = ("integer", "positive", "nonnegative", "real", "finite")

#: dtype name -> dtype, for every dtype torch knows (no getattr on payload strings).
DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bound(value: Any) -> Any:
    import sympy
    from torch.utils._sympy.numbers import IntInfinity, NegativeIntInfinity

    if isinstance(value, (IntInfinity,)) or value == sympy.oo:
        return "oo"
    if isinstance(value, NegativeIntInfinity) or value == -sympy.oo:
        return "-oo"
    if isinstance(value, (sympy.Integer, int)):
        return int(value)
    if isinstance(value, (sympy.Float, float)):
        return float(value)
    if value in (sympy.true, sympy.false, True, False):
        return bool(value)
    raise UnsupportedModule(f"unsupported value-range bound {value!r}")


def _unbound(value: Any) -> Any:
    import sympy
    from torch.utils._sympy.numbers import int_oo

    if value == "oo":
        return int_oo
    if value == "-oo":
        return -int_oo
    if isinstance(value, bool):
        return sympy.true if value else sympy.false
    if isinstance(value, (int, float)):
        return value
    raise CorruptSnapshot(f"bad value-range bound {value!r}")


class SymbolTable:
    """Save side: collects every symbol that an encoded expression mentions."""

    def __init__(self) -> None:
        self.symbols: dict[str, dict[str, Any]] = {}

    def add(self, sym: sympy.Symbol, shape_env: ShapeEnv | None) -> None:
        known = self.symbols.get(sym.name)
        if known is not None and (shape_env is None or known["hint"] is not None):
            return
        orig = getattr(sym, "_assumptions_orig", None) or sym.assumptions0
        info: dict[str, Any] = {"assumptions": {k: bool(orig[k]) for k in _ASSUMPTIONS if k in orig}}
        hint = None
        lo_hi = None
        if shape_env is not None:
            val = shape_env.backed_var_to_val.get(sym)
            if val is not None:
                hint = int(val) if getattr(val, "is_integer", False) else float(val)
            vr = shape_env.var_to_range.get(sym)
            if vr is not None:
                lo_hi = [_bound(vr.lower), _bound(vr.upper)]
        info["hint"] = hint
        info["range"] = lo_hi
        self.symbols[sym.name] = info

    def add_ranges(self, range_constraints: dict) -> list[list[Any]]:
        """Encode a ``range_constraints`` mapping (symbol -> ValueRanges)."""
        import sympy

        out = []
        for sym, vr in range_constraints.items():
            if not isinstance(sym, sympy.Symbol):
                raise UnsupportedModule(f"range constraint on a non-symbol {sym!r}")
            self.add(sym, None)
            out.append([sym.name, _bound(vr.lower), _bound(vr.upper)])
        return out

    def encode(self, value: Any) -> list[Any]:
        """Encode a SymInt/SymFloat/SymBool as ``["sym", kind, expr, hint]``."""
        node = value.node
        kind = "i" if isinstance(value, torch.SymInt) else "f" if isinstance(value, torch.SymFloat) else "b"
        expr = encode_expr(node.expr, self, node.shape_env)
        hint = node.hint
        if hint is not None:
            hint = int(hint) if kind == "i" else float(hint) if kind == "f" else bool(hint)
        return ["sym", kind, expr, hint]


def encode_expr(expr: Any, table: SymbolTable, shape_env: ShapeEnv | None) -> Any:
    """Encode a sympy expression as nested lists over a fixed set of heads."""
    import sympy
    from torch.utils._sympy.numbers import IntInfinity, NegativeIntInfinity

    if isinstance(expr, sympy.Symbol):
        table.add(expr, shape_env)
        return ["s", expr.name]
    if expr is sympy.true or expr is sympy.false:
        return bool(expr)
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Rational):
        return ["q", int(expr.p), int(expr.q)]
    if isinstance(expr, sympy.Float):
        return ["r", float(expr)]
    if isinstance(expr, (IntInfinity, NegativeIntInfinity)):
        return ["oo", 1 if isinstance(expr, IntInfinity) else -1]
    names = _func_names()
    head = names.get(type(expr)) or names.get(expr.func)
    if head is None:
        raise UnsupportedModule(f"symbolic expression {expr} uses {type(expr).__name__}, which snapshots do not encode")
    return ["f", head, [encode_expr(a, table, shape_env) for a in expr.args]]


class SymDecoder:
    """Load side: one ShapeEnv + FakeTensorMode shared by every graph of a snapshot.

    Both are made on first use, and a snapshot without symbols gets a
    FakeTensorMode without a ShapeEnv whose own initialisation waits for its
    first use (:mod:`~adstore.integration.snapshot.fakemode`): a static graph's
    restore then imports neither sympy nor dynamo.
    """

    def __init__(self, symbols: dict[str, dict[str, Any]], ranges: dict[str, list[Any]] | None = None) -> None:
        if not isinstance(symbols, dict):
            raise CorruptSnapshot("bad symbol table")
        for name, info in symbols.items():
            if not is_identifier(name) or not isinstance(info, dict):
                raise CorruptSnapshot(f"bad symbol entry {name!r}")
        self._encoded = symbols
        self._shape_env: ShapeEnv | None = None
        self._symbols: dict[str, sympy.Symbol] | None = None
        self._fake_mode: Any = None
        self._cache: dict[str, Any] = {}

    @property
    def fake_mode(self) -> Any:
        if self._fake_mode is None:
            if self._encoded:
                from torch._subclasses.fake_tensor import FakeTensorMode

                self._fake_mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=True)
            else:  # a static graph: built on first use, so a restart that only runs the model skips dynamo
                from adstore.integration.snapshot.fakemode import DeferredFakeTensorMode

                self._fake_mode = DeferredFakeTensorMode(allow_non_fake_inputs=True)
        return self._fake_mode

    @property
    def shape_env(self) -> ShapeEnv:
        if self._shape_env is None:
            self._build()
        assert self._shape_env is not None
        return self._shape_env

    @property
    def symbols(self) -> dict[str, sympy.Symbol]:
        if self._symbols is None:
            self._build()
        assert self._symbols is not None
        return self._symbols

    def _build(self) -> None:
        import sympy
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        from torch.utils._sympy.numbers import int_oo
        from torch.utils._sympy.value_ranges import ValueRanges
        from torch.utils._traceback import CapturedTraceback

        shape_env = ShapeEnv()
        symbols: dict[str, sympy.Symbol] = {}
        for name, info in self._encoded.items():
            assumptions = {k: bool(v) for k, v in info.get("assumptions", {}).items() if k in _ASSUMPTIONS}
            sym = sympy.Symbol(name, **assumptions)
            symbols[name] = sym
            hint = info.get("hint")
            if isinstance(hint, (int, float)) and not isinstance(hint, bool):
                shape_env.add_backed_var_to_val(sym, hint)
            else:  # unbacked (data-dependent, ``u0``): registered as create_unbacked_symint does
                shape_env.var_to_stack[sym] = CapturedTraceback.extract(skip=1)
                if name[:1] == "u" and name[1:].isascii() and name[1:].isdigit():
                    shape_env.unbacked_symint_counter = max(shape_env.unbacked_symint_counter, int(name[1:]) + 1)
            rng = info.get("range")
            if rng is not None:
                vr = ValueRanges(_unbound(rng[0]), _unbound(rng[1]))
            elif assumptions.get("positive"):
                vr = ValueRanges(2, int_oo)  # ShapeEnv's default for a backed size
            else:
                vr = ValueRanges(-int_oo, int_oo)
            shape_env._update_var_to_range(sym, vr)
        self._shape_env, self._symbols = shape_env, symbols

    def range_constraints(self, encoded: list[list[Any]]) -> dict:
        if not encoded:
            return {}
        from torch.utils._sympy.value_ranges import ValueRanges

        out = {}
        for name, lo, hi in encoded:
            if name not in self.symbols:
                raise CorruptSnapshot(f"range constraint names unknown symbol {name!r}")
            out[self.symbols[name]] = ValueRanges(_unbound(lo), _unbound(hi))
        return out

    def expr(self, enc: Any) -> Any:
        import sympy
        from torch.utils._sympy.numbers import int_oo

        if isinstance(enc, bool):
            return sympy.true if enc else sympy.false
        if isinstance(enc, int):
            return sympy.Integer(enc)
        if not isinstance(enc, list) or not enc:
            raise CorruptSnapshot(f"bad symbolic expression {enc!r}")
        tag = enc[0]
        if tag == "s":
            sym = self.symbols.get(enc[1])
            if sym is None:
                raise CorruptSnapshot(f"expression names unknown symbol {enc[1]!r}")
            return sym
        if tag == "q":
            return sympy.Rational(int(enc[1]), int(enc[2]))
        if tag == "r":
            return sympy.Float(float(enc[1]))
        if tag == "oo":
            return int_oo if enc[1] > 0 else -int_oo
        if tag == "f":
            fn = _funcs().get(enc[1])
            if fn is None:
                raise CorruptSnapshot(f"expression names unknown function {enc[1]!r}")
            return fn(*[self.expr(a) for a in enc[2]])
        raise CorruptSnapshot(f"bad symbolic expression tag {tag!r}")

    def sym(self, enc: list[Any]) -> Any:
        """Decode ``["sym", kind, expr, hint]`` into a SymInt/SymFloat/SymBool (or a plain number)."""
        _, kind, expr_enc, hint = enc
        expr = self.expr(expr_enc)
        if kind == "i":
            return self.shape_env.create_symintnode(expr, hint=hint)
        if kind == "f":
            return self.shape_env.create_symfloatnode(expr, hint=hint)
        if kind == "b":
            return self.shape_env.create_symboolnode(expr)
        raise CorruptSnapshot(f"bad symbolic kind {kind!r}")
