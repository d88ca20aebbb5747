"""Hypothesis round trips of the structural arg/meta encoding."""

from __future__ import annotations

import json
import math

import sympy
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

from adstore.integration.snapshot.tensor_meta import DTYPES, SymbolTable, SymDecoder
from adstore.integration.snapshot.values import LAYOUTS, MEMORY_FORMATS, ValueDecoder, ValueEncoder

_graph = torch.fx.Graph()
NODES = [_graph.placeholder(f"x{i}") for i in range(4)]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(sorted(DTYPES.values(), key=str)),
    st.sampled_from([torch.device("cpu"), torch.device("meta"), torch.device("cuda", 1)]),
    st.sampled_from(sorted(LAYOUTS.values(), key=str)),
    st.sampled_from(sorted(MEMORY_FORMATS.values(), key=str)),
    st.just(Ellipsis),
    st.complex_numbers(allow_nan=False, allow_infinity=False),
    st.sampled_from(NODES),
    st.lists(st.integers(min_value=0, max_value=2**31), max_size=4).map(torch.Size),
    st.builds(slice, st.none() | st.integers(), st.none() | st.integers(), st.none() | st.integers()),
    st.sampled_from([torch.ops.aten.add.Tensor, torch.relu, math.sqrt, torch.float32.__class__]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), inner, max_size=4),
    ),
    max_leaves=20,
)


def same(a, b) -> bool:
    """Equality that also checks types (bool vs int, tuple vs list) and NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.fx.Node):
        return a is b
    return a == b


@settings(max_examples=300, deadline=None)
@given(values)
def test_value_roundtrip(v):
    enc = ValueEncoder(node_index={n: i for i, n in enumerate(NODES)})
    text = json.dumps(enc.encode(v), allow_nan=False)  # strict JSON: non-finite floats are tagged
    out = ValueDecoder(nodes=NODES).decode(json.loads(text))
    assert same(v, out), (v, out)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=2, max_value=512), min_size=1, max_size=3), st.integers(min_value=1, max_value=7))
def test_symbolic_expression_roundtrip(hints, k):
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy.functions import FloorDiv, Max, Mod

    env = ShapeEnv()
    syms = []
    for i, h in enumerate(hints):
        s = sympy.Symbol(f"s{i}", integer=True, positive=True)
        env.add_backed_var_to_val(s, h)
        from torch.utils._sympy.value_ranges import ValueRanges

        env._update_var_to_range(s, ValueRanges(2, 1024))
        syms.append(s)
    exprs = [syms[0] * k, FloorDiv(syms[0], k), Mod(syms[0], k), sum(syms) + k, Max(syms[0], syms[-1])]
    table = SymbolTable()
    encoded = []
    for e in exprs:
        si = env.create_symintnode(e, hint=None)
        if isinstance(si, int):
            continue
        encoded.append((table.encode(si), si))
    payload = json.loads(json.dumps({"symbols": table.symbols, "vals": [e for e, _ in encoded]}))
    dec = SymDecoder(payload["symbols"])
    for enc, orig in encoded:
        got = dec.sym(enc)
        assert str(got.node.expr) == str(orig.node.expr)
        assert got.node.hint == orig.node.hint
    for s in syms:
        assert dec.shape_env.var_to_range[dec.symbols[s.name]].upper == 1024


@settings(max_examples=30, deadline=None)
@given(st.integers(min_value=2, max_value=4096), st.integers(min_value=1, max_value=9))
def test_symint_args_keep_expression_and_hint(hint, k):
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy.value_ranges import ValueRanges

    env = ShapeEnv()
    s = sympy.Symbol("s5", integer=True, positive=True)
    env.add_backed_var_to_val(s, hint)
    env._update_var_to_range(s, ValueRanges(2, 8192))
    si = env.create_symintnode(s, hint=hint)
    value = {"size": torch.Size([si, k]), "pair": (si * k, [si // k, si + k])}
    enc = ValueEncoder()
    text = json.dumps({"v": enc.encode(value), "symbols": enc.symbols.symbols})
    data = json.loads(text)
    dec = SymDecoder(data["symbols"])
    out = ValueDecoder(sym=dec.sym).decode(data["v"])
    assert type(out["size"]) is torch.Size and type(out["pair"]) is tuple and type(out["pair"][1]) is list
    flat_in = [value["size"][0], value["pair"][0], *value["pair"][1]]
    flat_out = [out["size"][0], out["pair"][0], *out["pair"][1]]
    for a, b in zip(flat_in, flat_out, strict=True):
        assert isinstance(b, torch.SymInt)
        assert str(b.node.expr) == str(a.node.expr)
        assert b.node.hint == a.node.hint and int(b.node.hint) == int(a.node.hint)
    assert out["size"][1] == k
