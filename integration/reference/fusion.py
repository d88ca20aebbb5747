"""Post-load fusion: linears that read the same input become one wider linear.

q/k/v projections and gate/up projections each read one activation; after the
weights are real (and already sharded), their weights are concatenated into
one parameter, one matmul replaces several, and a split hands every former
user its slice.  This runs after the cache point because it needs the loaded
weights; it is the reason the cached snapshot must stop before weight loading.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn

from adstore.integration.errors import IntegrationError
from adstore.integration.pipeline.graphs import graph_modules
from adstore.integration.pipeline.transforms import PipelineContext, Stage, Transform, TransformConfig

__all__ = ["FuseLinears", "fuse_parallel_linears"]

log = logging.getLogger(__name__)
aten = torch.ops.aten


def _param(gm: fx.GraphModule, node: object) -> torch.Tensor | None:
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    try:
        value = gm.get_parameter(node.target)
    except AttributeError:
        return None
    return value


def fuse_parallel_linears(gm: fx.GraphModule, *, min_group: int = 2) -> int:
    """Fuse groups of ``aten.linear`` sharing an input; returns groups fused."""
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.linear.default and isinstance(node.args[0], fx.Node):
            groups.setdefault(node.args[0], []).append(node)
    fused = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for inp, members in groups.items():
        if len(members) < min_group:
            continue
        weights = [_param(gm, m.args[1]) for m in members]
        if any(w is None or w.device.type == "meta" or w.dim() != 2 for w in weights):
            continue
        if len({(w.dtype, w.shape[1], w.device) for w in weights}) != 1:  # type: ignore[union-attr]
            continue
        biases = [m.args[2] if len(m.args) > 2 else None for m in members]
        has_bias = [b is not None for b in biases]
        if any(has_bias) and not all(has_bias):
            continue
        bias_t = [_param(gm, b) for b in biases] if all(has_bias) else None
        if bias_t is not None and any(b is None for b in bias_t):
            continue
        name = f"fused_linear_{fused}"
        while hasattr(gm, name):
            name += "_"
        gm.register_parameter(name, nn.Parameter(torch.cat(weights, dim=0), requires_grad=False))  # type: ignore[arg-type]
        bias_name = None
        if bias_t is not None:
            bias_name = f"{name}_bias"
            gm.register_parameter(bias_name, nn.Parameter(torch.cat(bias_t, dim=0), requires_grad=False))  # type: ignore[arg-type]
        sizes = [int(w.shape[0]) for w in weights]  # type: ignore[union-attr]
        first = min(members, key=order.__getitem__)
        with gm.graph.inserting_before(first):
            w_node = gm.graph.get_attr(name)
            args: tuple = (inp, w_node)
            if bias_name is not None:
                args = (inp, w_node, gm.graph.get_attr(bias_name))
            big = gm.graph.call_function(aten.linear.default, args)
            parts = gm.graph.call_function(aten.split_with_sizes.default, (big, sizes, -1))
            for i, m in enumerate(members):
                piece = gm.graph.call_function(operator.getitem, (parts, i))
                m.replace_all_uses_with(piece)
                for user in list(piece.users):
                    # split pieces are strided views: ``view`` may refuse them, ``reshape`` copies if needed
                    if user.op == "call_function" and user.target is aten.view.default:
                        user.target = aten.reshape.default
        for m in members:
            operands = [a for a in m.args[1:] if isinstance(a, fx.Node)]
            gm.graph.erase_node(m)
            for a in operands:  # the unfused weights' get_attr nodes (a full DCE pass costs more)
                if a.op == "get_attr" and not a.users:
                    gm.graph.erase_node(a)
        fused += 1
    if fused:
        _drop_unused_params(gm)
        gm.graph.lint()
        gm.recompile()
    return fused


def _drop_unused_params(gm: fx.GraphModule) -> None:
    """Delete parameters no ``get_attr`` references any more (the unfused weights)."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for qual, _ in list(gm.named_parameters()):
        if qual in used:
            continue
        owner, _, leaf = qual.rpartition(".")
        mod = gm.get_submodule(owner) if owner else gm
        del mod._parameters[leaf]


@dataclass(kw_only=True)
class FusionConfig(TransformConfig):
    min_group: int = 2


class FuseLinears(Transform):
    name = "fuse_linears"
    stage = Stage.POST_LOAD_FUSION
    config_cls = FusionConfig

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        if module is None:
            raise IntegrationError("fuse_linears needs a loaded module")
        min_group = self.config.min_group  # type: ignore[attr-defined]
        total = sum(fuse_parallel_linears(gm, min_group=min_group) for _, gm in graph_modules(module))
        ctx.info[self.name] = {"groups": total}
        return module
