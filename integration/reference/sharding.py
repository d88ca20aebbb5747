"""Tensor-parallel sharding of linear layers on the exported graph.

The plan comes from the model's own tensor-parallel plan (``colwise``,
``rowwise``, ``colwise_gather_output`` per module pattern).  For each rank:

* a column-parallel linear keeps ``out_features / world_size`` rows of its
  weight (and bias); a row-parallel linear keeps ``in_features / world_size``
  columns and is followed by an ``adstore.all_reduce``; a gathered column
  linear (the LM head) is followed by ``adstore.all_gather``;
* parameters become meta tensors of the local shape, and a
  :class:`TPShardHook` load-state-dict pre-hook per tensor slices the full
  checkpoint tensor when weights load;
* between a column- and a row-parallel linear the sharded dimension is tracked
  through reshapes, transposes, expands and attention, and baked shape
  arguments (head counts after ``repeat_kv``) are divided by the world size.

Anything the tracker does not understand is an error naming the op, not a
silently wrong graph.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from adstore.integration.errors import IntegrationError
from adstore.integration.pipeline.graphs import graph_modules, propagate_shapes
from adstore.integration.pipeline.transforms import PipelineContext, Stage, Transform, TransformConfig
from adstore.integration.reference import ops as _ops  # noqa: F401
from adstore.integration.snapshot.hooks import TPShardHook
from adstore.store import Reason

__all__ = ["ShardLinears", "ShardingError", "shard_graph"]

log = logging.getLogger(__name__)
aten = torch.ops.aten


class ShardingError(IntegrationError):
    """The graph cannot be sharded as planned (unsupported op between linears)."""

    reason = Reason.SHARDING


def _plan_regex(plan: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    """The plan's patterns (``layers.*.mlp``, ``*``: a layer number, ASCII digits) as whole-string regexes."""
    out = []
    for pattern, style in plan.items():
        rx = re.escape(pattern).replace(r"\*", "[0-9]+")
        out.append((re.compile(rx, re.ASCII), style))
    return out


def _style_for(owner: str, plan: list[tuple[re.Pattern[str], str]]) -> str | None:
    for rx, style in plan:
        if rx.fullmatch(owner):
            return style
    return None


def _val(node: Any) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _hint(size: Any) -> int:
    """A concrete size: the example value behind a symbolic dim."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else int(size)
    return int(size)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


_ELEMENTWISE_OK = {
    aten.mul.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.div.Tensor,
    aten.neg.default,
    aten.silu.default,
    aten.gelu.default,
    aten.contiguous.default,
    aten.clone.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.type_as.default,
    aten.alias.default,
    aten.sigmoid.default,
    aten.tanh.default,
    aten.pow.Tensor_Scalar,
    torch.ops.adstore.silu_mul.default,
    torch.ops.adstore.rms_norm.default,
    torch.ops.adstore.rope.default,
}


class _Tracker:
    """Computes, for each node downstream of a column-parallel linear, the sharded dim."""

    def __init__(self, ws: int) -> None:
        self.ws = ws
        self.dim: dict[fx.Node, int] = {}
        self.new_args: dict[fx.Node, tuple[Any, ...]] = {}

    def fail(self, node: fx.Node, why: str) -> ShardingError:
        return ShardingError(f"cannot shard through {node.format_node()}: {why}")

    def output_dim(self, node: fx.Node) -> int:
        """Sharded dim of ``node``'s output; records shape-arg rewrites."""
        ws = self.ws
        out_v = _val(node)
        if out_v is None:
            raise self.fail(node, "no shape metadata")
        sharded = [a for a in node.all_input_nodes if a in self.dim]
        src = sharded[0]
        d = self.dim[src]
        in_v = _val(src)
        assert in_v is not None
        t = node.target
        args = list(node.args)
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            s_in, s_out = list(in_v.shape), list(out_v.shape)
            before = math.prod(s_in[:d])
            k = next((i for i in range(len(s_out)) if math.prod(s_out[:i]) == before and s_out[i] != 1), None)
            if k is None or s_out[k] % ws or s_in[d] % ws:
                raise self.fail(node, f"sharded dim {d} of {s_in} does not map onto {s_out} for world size {ws}")
            shape = list(args[1])
            if shape[k] != -1:
                shape[k] = shape[k] // ws
                args[1] = shape
                self.new_args[node] = tuple(args)
            return k
        if t is aten.expand.default:
            sizes = list(args[1])
            k = d + (len(sizes) - in_v.dim())
            if sizes[k] != -1:
                if sizes[k] % ws:
                    raise self.fail(node, f"size {sizes[k]} not divisible by {ws}")
                sizes[k] //= ws
                args[1] = sizes
                self.new_args[node] = tuple(args)
            return k
        if t is aten.transpose.int:
            a, b = _norm_dim(args[1], in_v.dim()), _norm_dim(args[2], in_v.dim())
            return b if d == a else a if d == b else d
        if t is aten.permute.default:
            dims = [_norm_dim(x, in_v.dim()) for x in args[1]]
            return dims.index(d)
        if t is aten.unsqueeze.default:
            u = _norm_dim(args[1], out_v.dim())
            return d + 1 if u <= d else d
        if t in (aten.slice.Tensor, aten.select.int, aten.narrow.default):
            sd = _norm_dim(args[1] if len(args) > 1 else 0, in_v.dim())
            if sd == d:
                raise self.fail(node, "slices the sharded dim")
            return d - 1 if (t is aten.select.int and sd < d) else d
        if t is aten.cat.default:
            parts = args[0]
            cd = _norm_dim(args[1] if len(args) > 1 else 0, in_v.dim())
            if cd == d or any(p not in self.dim or self.dim[p] != d for p in parts):
                raise self.fail(node, "concatenates along or with unsharded tensors")
            return d
        if t is aten.scaled_dot_product_attention.default:
            q, k_, v = args[:3]
            if any(x not in self.dim or self.dim[x] != 1 for x in (q, k_, v)):
                raise self.fail(node, "q, k, v must all be sharded over heads (dim 1)")
            return 1
        if t in _ELEMENTWISE_OK:
            k = d + (out_v.dim() - in_v.dim())
            if k < 0 or out_v.shape[k] != in_v.shape[d]:
                raise self.fail(node, "not shape-preserving on the sharded dim")
            for other in node.all_input_nodes:
                ov = _val(other)
                if other in self.dim:
                    if self.dim[other] + (out_v.dim() - ov.dim()) != k:  # type: ignore[union-attr]
                        raise self.fail(node, "inputs sharded on different dims")
                    continue
                if ov is None or ov.dim() == 0:
                    continue
                od = k - (out_v.dim() - ov.dim())
                if od >= 0 and ov.shape[od] != 1:
                    if t is torch.ops.adstore.rms_norm.default and other is node.args[1]:
                        continue  # norm weight spans only the last dim
                    raise self.fail(node, f"unsharded operand {other.name} spans the sharded dim")
            return k
        raise self.fail(node, "op not supported between column- and row-parallel linears")


def _group_of(node: fx.Node) -> str:
    """The owner module of a linear's weight's module (``model.layers.0.self_attn``)."""
    return node.args[1].target.rsplit(".", 2)[0]


def _track_region(
    col: list[fx.Node], rows: list[fx.Node], world_size: int, order: dict[fx.Node, int]
) -> dict[fx.Node, tuple[Any, ...]]:
    """Follow the sharded dim from ``col`` to ``rows``; the shape-arg rewrites it needs."""
    row = set(rows)
    tracker = _Tracker(world_size)
    pending: set[fx.Node] = set()
    for node in col:
        tracker.dim[node] = _val(node).dim() - 1  # type: ignore[union-attr]
        pending.update(node.users)
    reached: set[fx.Node] = set()
    while pending:
        node = min(pending, key=order.__getitem__)
        pending.discard(node)
        if node in tracker.dim:
            continue
        if node in row:
            if node.args[0] not in tracker.dim or tracker.dim[node.args[0]] != _val(node.args[0]).dim() - 1:
                raise ShardingError(f"row-parallel {node.name} input is not sharded on its last dim")
            if len(node.args) > 2 and node.args[2] is not None:
                raise ShardingError(f"row-parallel {node.name} has a bias (unsupported)")
            reached.add(node)
            continue
        if node.op != "call_function" or (node.target is aten.linear.default and node.args[0] in tracker.dim):
            raise ShardingError(f"sharded value reaches {node.op} {node.name} outside its region")
        tracker.dim[node] = tracker.output_dim(node)
        pending.update(node.users)
    if reached != row:
        raise ShardingError(f"row-parallel linears without sharded input: {sorted(n.name for n in row - reached)}")
    return tracker.new_args


def shard_graph(gm: fx.GraphModule, plan: dict[str, str], rank: int, world_size: int) -> dict[str, int]:
    """Shard ``gm`` in place for ``rank`` of ``world_size``; returns counts per style.

    Deterministic: every list here is in graph order (never a set's iteration
    order, which follows memory addresses), so the inserted collectives get the
    same names, and the load hooks the same order, in every process and on every
    rank: equal inputs give a byte-identical snapshot.
    """
    regex = _plan_regex(plan)
    col: list[fx.Node] = []
    gather: list[fx.Node] = []
    row: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        weight = node.args[1]
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target.endswith(".weight")):
            continue
        style = _style_for(weight.target[: -len(".weight")], regex)
        if style == "colwise":
            col.append(node)
        elif style == "colwise_gather_output":
            gather.append(node)
        elif style == "rowwise":
            row.append(node)

    # Regions are the plan's owner modules (``...self_attn``, ``...mlp``): each is
    # tracked on its own, and one the tracker cannot follow stays replicated.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[str, tuple[list[fx.Node], list[fx.Node]]] = {}
    for node in col:
        groups.setdefault(_group_of(node), ([], []))[0].append(node)
    for node in row:
        groups.setdefault(_group_of(node), ([], []))[1].append(node)
    new_args: dict[fx.Node, tuple[Any, ...]] = {}
    sharded_col: list[fx.Node] = []
    sharded_row: list[fx.Node] = []
    replicated: list[str] = []
    for name, (g_col, g_row) in groups.items():
        try:
            if not g_col or not g_row:
                raise ShardingError(f"{name}: needs both column- and row-parallel linears")
            new_args.update(_track_region(g_col, g_row, world_size, order))
        except ShardingError as exc:
            replicated.append(name)
            log.info("tp_sharding: %s stays replicated: %s", name, exc)
            continue
        sharded_col.extend(g_col)
        sharded_row.extend(g_row)
    col = sorted(sharded_col, key=order.__getitem__)
    row = sorted(sharded_row, key=order.__getitem__)

    # ---- apply: parameters, hooks, shape args, collectives
    def shard_param(target: str, dim: int) -> None:
        owner, _, leaf = target.rpartition(".")
        mod = gm.get_submodule(owner)
        old = mod._parameters[leaf]
        if old is None:
            return
        hook = TPShardHook(target, tuple(old.shape), dim, rank, world_size)
        mod._parameters[leaf] = nn.Parameter(
            torch.empty(hook.local_shape, dtype=old.dtype, device="meta"), requires_grad=False
        )
        gm._register_load_state_dict_pre_hook(hook)

    for node in col + gather:
        shard_param(node.args[1].target, 0)
        if len(node.args) > 2 and isinstance(node.args[2], fx.Node):
            shard_param(node.args[2].target, 0)
    for node in row:
        shard_param(node.args[1].target, 1)
    for node, args in new_args.items():
        node.args = args
    for node in row:
        with gm.graph.inserting_after(node):
            red = gm.graph.call_function(torch.ops.adstore.all_reduce.default, (node,))
        node.replace_all_uses_with(red, delete_user_cb=lambda u, red=red: u is not red)
    for node in gather:
        with gm.graph.inserting_after(node):
            gat = gm.graph.call_function(torch.ops.adstore.all_gather.default, (node, -1, world_size))
        node.replace_all_uses_with(gat, delete_user_cb=lambda u, gat=gat: u is not gat)
    gm.graph.lint()
    gm.recompile()
    return {
        "colwise": len(col),
        "rowwise": len(row),
        "gathered": len(gather),
        "reshapes": len(new_args),
        "replicated_regions": len(replicated),
    }


@dataclass(kw_only=True)
class ShardConfig(TransformConfig):
    shard_lm_head: bool = True
    shard_mlp: bool = True


class ShardLinears(Transform):
    """Tensor-parallel sharding for ``world_size > 1`` (a no-op for one rank)."""

    name = "tp_sharding"
    stage = Stage.SHARDING
    config_cls = ShardConfig

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        cfg: ShardConfig = self.config  # type: ignore[assignment]
        if module is None:
            raise IntegrationError("tp_sharding needs an exported module")
        if ctx.world_size == 1:
            ctx.info[self.name] = {"world_size": 1}
            return module
        plan = ctx.factory.tp_plan()
        if not cfg.shard_lm_head:
            plan = {k: v for k, v in plan.items() if k != "lm_head"}
        if not cfg.shard_mlp:
            plan = {k: v for k, v in plan.items() if ".mlp." not in k}
        stats: dict[str, int] = {}
        for _, gm in graph_modules(module):
            got = shard_graph(gm, plan, ctx.rank, ctx.world_size)
            stats = {k: stats.get(k, 0) + v for k, v in got.items()}
            inputs = tuple(
                torch.zeros(tuple(_hint(d) for d in n.meta["val"].shape), dtype=n.meta["val"].dtype)
                for n in gm.graph.nodes
                if n.op == "placeholder"
            )
            propagate_shapes(gm, inputs)
        ctx.info[self.name] = {"world_size": ctx.world_size, **stats}
        return module
