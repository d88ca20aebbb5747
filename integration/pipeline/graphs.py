"""FX helpers shared by transforms: find the graphs of a module, retarget devices, propagate shapes, canonical order."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import fx, nn

__all__ = ["canonicalize", "graph_modules", "propagate_shapes", "replace_devices"]


def graph_modules(module: nn.Module) -> list[tuple[str, fx.GraphModule]]:
    """The module itself if it is a GraphModule, else its outermost GraphModule children."""
    if isinstance(module, fx.GraphModule):
        return [("", module)]
    found: list[tuple[str, fx.GraphModule]] = []
    for name, child in module.named_children():
        found.extend((f"{name}.{sub}" if sub else name, gm) for sub, gm in graph_modules(child))
    return found


def _other_device(value: Any, device: torch.device) -> bool:
    if isinstance(value, torch.device):
        return value != device
    if isinstance(value, (list, tuple)):
        return any(_other_device(v, device) for v in value)
    if isinstance(value, dict):
        return any(_other_device(v, device) for v in value.values())
    return False


def _swap_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(_swap_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _swap_device(v, device) for k, v in value.items()}
    return value


def replace_devices(gm: fx.GraphModule, device: str | torch.device) -> int:
    """Point every device argument baked into the graph at ``device``; returns nodes changed."""
    dev = torch.device(device)
    count = 0
    for node in gm.graph.nodes:
        if _other_device(node.args, dev) or _other_device(node.kwargs, dev):
            node.args, node.kwargs = _swap_device(node.args, dev), _swap_device(node.kwargs, dev)
            count += 1
    return count


def propagate_shapes(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], device: str = "cpu") -> None:
    """Recompute every node's ``meta["val"]`` with fake tensors (no memory, no weights).

    Parameters and buffers become fake tensors on ``device`` with their shapes,
    so meta parameters and real buffers mix freely.  A shape error here means a
    rewrite produced an inconsistent graph and surfaces before any weight loads.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:

        def fake(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)

        state = {n: fake(t) for n, t in list(gm.named_parameters()) + list(gm.named_buffers())}
        args = iter(fake(t) for t in inputs)

        class _Prop(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                if n.op == "placeholder":
                    out = next(args)
                elif n.op == "get_attr":
                    out = state.get(n.target)
                    if out is None:
                        out = super().run_node(n)
                else:
                    out = super().run_node(n)
                if isinstance(out, torch.Tensor):
                    n.meta["val"] = out
                return out

        _Prop(gm).run()


_COUNTER = re.compile(r"_\d+$")


def _data_flow_order(graph: fx.Graph) -> list[fx.Node] | None:
    """The nodes in an order that depends only on the data flow: placeholders, then a depth-first
    post-order from each sink (a node without users, the output last), inputs in argument order.

    None if some node is reached by no sink (it would be dropped).
    """
    nodes = list(graph.nodes)
    order = [n for n in nodes if n.op == "placeholder"]
    seen = set(order)
    sinks = [n for n in nodes if not n.users and n.op not in ("placeholder", "output")]
    sinks += [n for n in nodes if n.op == "output"]
    for sink in sinks:
        stack: list[tuple[fx.Node, bool]] = [(sink, False)]
        while stack:  # iterative: a deep graph would overflow Python's recursion limit
            node, inputs_done = stack.pop()
            if inputs_done:
                order.append(node)
            elif node not in seen:
                seen.add(node)
                stack.append((node, True))
                stack.extend((i, False) for i in reversed(node.all_input_nodes) if i not in seen)
    return order if len(order) == len(nodes) else None


def canonicalize(gm: fx.GraphModule) -> bool:
    """Reorder and rename ``gm``'s nodes from its data flow alone; False if the graph is left as it was.

    ``torch.export`` records nodes in the order the model's Python ran, and
    some models iterate over sets (``for layer_type in set(config.layer_types)``:
    string hashes, so the order changes with ``PYTHONHASHSEED``): the same graph
    then comes out in another order, with other node names and trace counters,
    from one process to the next.  After this pass it does not: nodes follow the
    data flow (:func:`_data_flow_order`), each name is its base (the name without
    its ``_N`` counter) numbered again in that order, and so are the trace
    counters in the ``torch_fn`` and ``nn_module_stack`` metadata.  Placeholders, get_attr targets and the output keep
    their names and the values computed are untouched.
    """
    graph = gm.graph
    order = _data_flow_order(graph)
    if order is None:
        return False
    new = fx.Graph(owning_module=gm, tracer_cls=graph._tracer_cls, tracer_extras=graph._tracer_extras)
    new._codegen = graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    fn_names, calls = _Renumber(lambda base, n: f"{base}_{n}"), _Renumber(lambda base, n: f"{base}@{n}" if n else base)
    for node in order:
        keep = node.op in ("placeholder", "output")
        name = node.name if keep else _COUNTER.sub("", node.name)
        args = fx.map_arg(node.args, env.__getitem__)
        kwargs = fx.map_arg(node.kwargs, env.__getitem__)
        copied = new.create_node(node.op, node.target, args, kwargs, name=name, type_expr=node.type)  # type: ignore[arg-type]
        copied.meta = dict(node.meta)
        fn = copied.meta.get("torch_fn")
        if isinstance(fn, tuple) and len(fn) == 2 and isinstance(fn[0], str):
            copied.meta["torch_fn"] = (fn_names(fn[0], _COUNTER.sub("", fn[0])), fn[1])
        stack = copied.meta.get("nn_module_stack")
        if isinstance(stack, dict):  # a module called again is ``path@N``, N counting calls in trace order
            copied.meta["nn_module_stack"] = {
                calls(k, k.split("@")[0]) if isinstance(k, str) else k: v for k, v in stack.items()
            }
        env[node] = copied
    gm.graph = new
    return True


class _Renumber:
    """Old name -> ``fmt(base, n)``, ``n`` counting the distinct old names of each base in first-seen order."""

    def __init__(self, fmt: Any) -> None:
        self.fmt = fmt
        self.names: dict[str, str] = {}
        self.counts: dict[str, int] = {}

    def __call__(self, old: str, base: str) -> str:
        if old not in self.names:
            n = self.counts.get(base, 0)
            self.names[old], self.counts[base] = self.fmt(base, n), n + 1
        return self.names[old]
