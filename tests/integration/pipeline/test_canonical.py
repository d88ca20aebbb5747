"""``canonicalize``: the same graph traced in another order becomes the same nodes, names and snapshot bytes."""

from __future__ import annotations

import torch
from torch import fx, nn

from adstore.integration.pipeline.graphs import canonicalize
from adstore.integration.snapshot import dump_module


class _Rotary(nn.Module):
    def forward(self, x: torch.Tensor, k: float) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cos(x * k), torch.sin(x * k)


class _Model(nn.Module):
    """Computes one table per kind in ``order`` (like ``for t in set(config.layer_types)``), then uses them."""

    def __init__(self, order: tuple[str, ...]) -> None:
        super().__init__()
        self.order = order
        self.rotary = _Rotary()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tables = {kind: self.rotary(x, {"full": 1.0, "sliding": 2.0}[kind]) for kind in self.order}
        h = self.proj(x)
        for kind in ("sliding", "full", "sliding"):
            cos, sin = tables[kind]
            h = h * cos + torch.flip(h, [-1]) * sin
        return h


def _exported(order: tuple[str, ...]) -> fx.GraphModule:
    torch.manual_seed(0)
    model = _Model(order).eval()
    gm = torch.export.export(model, (torch.randn(2, 8),)).module()
    for node in list(gm.graph.nodes):  # as cleanup_export does, before it canonicalizes
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    gm._forward_pre_hooks.clear()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def test_two_trace_orders_give_one_graph_and_one_snapshot():
    a, b = _exported(("full", "sliding")), _exported(("sliding", "full"))
    assert a.code != b.code  # the traces differ: order, names, trace counters
    x = torch.randn(2, 8)
    expected = a(x)
    assert canonicalize(a) and canonicalize(b)
    assert a.code == b.code
    for na, nb in zip(a.graph.nodes, b.graph.nodes, strict=True):
        assert (na.name, na.meta.get("torch_fn"), na.meta.get("nn_module_stack")) == (
            nb.name,
            nb.meta.get("torch_fn"),
            nb.meta.get("nn_module_stack"),
        )
    assert any("@1" in k for n in a.graph.nodes for k in n.meta.get("nn_module_stack", {}))  # called twice
    assert torch.equal(a(x), expected) and torch.equal(b(x), expected)
    a, b = a.to("meta"), b.to("meta")  # a snapshot holds no weights
    assert dump_module(a) == dump_module(b)
    placeholders = [n.name for n in a.graph.nodes if n.op == "placeholder"]
    assert placeholders == [n.name for n in _exported(("full", "sliding")).graph.nodes if n.op == "placeholder"]
    snapshot = dump_module(a)
    assert canonicalize(a) and dump_module(a) == snapshot  # a fixed point


def test_every_node_is_kept_and_a_graph_it_cannot_order_is_left_alone():
    gm = _exported(("full", "sliding"))
    with gm.graph.inserting_before(next(iter(gm.graph.nodes)).next):
        gm.graph.call_function(torch.ops.aten._assert_scalar.default, (True, "kept"))  # impure, no users
    before = len(gm.graph.nodes)
    assert canonicalize(gm) and len(gm.graph.nodes) == before
    assert any(n.target is torch.ops.aten._assert_scalar.default for n in gm.graph.nodes)
    # A graph whose nodes do not all lead to a sink (a cycle) is not a DAG the pass can order.
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.neg, (x,))
    z = g.call_function(torch.add, (y, y))
    y.args = (z,)
    g.output(x)
    cyclic = fx.GraphModule(nn.Module(), g, class_name="Cyclic")
    code = cyclic.code
    assert not canonicalize(cyclic) and cyclic.code == code
