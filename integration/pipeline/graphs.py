"""FX helpers shared by transforms: find the graphs of a module, retarget devices, propagate shapes."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

__all__ = ["graph_modules", "propagate_shapes", "replace_devices"]


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
