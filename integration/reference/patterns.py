"""Pattern rewrites: replace matched ATen subgraphs by ``adstore`` custom ops.

Matching walks the graph structurally from an anchor node (``rsqrt`` for
RMSNorm, ``silu`` for SwiGLU) instead of tracing a pattern graph, because the
exported graphs carry incidental casts (``to.dtype``, ``type_as``) that differ
between architectures; the walk tolerates them and checks every intermediate
has no other users before anything is replaced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from adstore.integration.errors import IntegrationError
from adstore.integration.pipeline.graphs import graph_modules
from adstore.integration.pipeline.transforms import PipelineContext, Stage, Transform, TransformConfig
from adstore.integration.reference import ops as _ops  # noqa: F401

__all__ = ["MatchRMSNorm", "MatchRoPE", "MatchSwiGLU", "rewrite_rms_norm", "rewrite_rope", "rewrite_swiglu"]

log = logging.getLogger(__name__)

aten = torch.ops.aten
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default}


def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _strip_cast(node: Any) -> Any:
    """The tensor under a chain of dtype casts."""
    while _is(node, *_CASTS):
        node = node.args[0]
    return node


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _other(node: fx.Node, known: Any) -> Any:
    a, b = node.args[0], node.args[1]
    if a is known:
        return b
    if b is known:
        return a
    return None


def _weight_operand(operand: Any) -> tuple[fx.Node, float] | None:
    """``weight`` or ``1 + weight`` (Gemma), under optional casts -> (get_attr node, offset)."""
    operand = _strip_cast(operand)
    offset = 0.0
    if _is(operand, aten.add.Tensor, aten.add.Scalar) and isinstance(operand.args[1], (int, float)):
        offset = float(operand.args[1])
        operand = _strip_cast(operand.args[0])
    elif _is(operand, aten.add.Tensor) and isinstance(operand.args[0], (int, float)):
        offset = float(operand.args[0])
        operand = _strip_cast(operand.args[1])
    if isinstance(operand, fx.Node) and operand.op == "get_attr":
        return operand, offset
    return None


def _replace_with(gm: fx.GraphModule, old: fx.Node, op: Any, args: tuple[Any, ...]) -> None:
    """Put ``op(*args)`` where ``old`` was; it keeps ``old``'s value, trace and module path."""
    with gm.graph.inserting_before(old):
        new = gm.graph.call_function(op, args)
    new.meta.update({k: v for k, v in old.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
    old.replace_all_uses_with(new)


def _finish(gm: fx.GraphModule, count: int) -> int:
    """After ``count`` rewrites: drop the replaced subgraphs and regenerate the code."""
    if count:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return count


def rewrite_rms_norm(gm: fx.GraphModule) -> int:
    """``w * (x * rsqrt(mean(x**2, -1) + eps))`` -> ``adstore.rms_norm(x, w, eps, offset)``."""
    count = 0
    for r in list(gm.graph.nodes):
        if not _is(r, aten.rsqrt.default):
            continue
        add = r.args[0]
        if not (_is(add, aten.add.Tensor, aten.add.Scalar) and isinstance(add.args[1], (int, float))):
            continue
        eps = float(add.args[1])
        mean = add.args[0]
        if not (_is(mean, aten.mean.dim) and list(mean.args[1]) in ([-1],) and (len(mean.args) > 2 and mean.args[2])):
            continue
        pw = mean.args[0]
        if not (_is(pw, aten.pow.Tensor_Scalar) and pw.args[1] == 2):
            continue
        h = pw.args[0]
        norm = _only_user(r)
        if norm is None or not _is(norm, aten.mul.Tensor) or _other(norm, r) is not h:
            continue
        # optional cast back, then the weight multiply
        nxt = _only_user(norm)
        while nxt is not None and _is(nxt, aten.to.dtype, aten._to_copy.default):
            nxt = _only_user(nxt)
        if nxt is None or not _is(nxt, aten.mul.Tensor):
            continue
        prev = nxt.args[0] if _strip_cast(nxt.args[0]) is norm else nxt.args[1]
        weight = _weight_operand(_other(nxt, prev))
        if weight is None:
            continue
        w_node, offset = weight
        out = nxt
        if offset != 0.0:
            # Gemma: (norm * (1 + w)).type_as(x)
            tail = _only_user(nxt)
            if tail is not None and _is(tail, aten.type_as.default, aten.to.dtype):
                out = tail
        x = h.args[0] if _is(h, aten.to.dtype, aten._to_copy.default) else h
        _replace_with(gm, out, torch.ops.adstore.rms_norm.default, (x, w_node, eps, offset))
        count += 1
    return _finish(gm, count)


def rewrite_swiglu(gm: fx.GraphModule) -> int:
    """``silu(gate) * up`` -> ``adstore.silu_mul(gate, up)``."""
    count = 0
    for s in list(gm.graph.nodes):
        if not _is(s, aten.silu.default):
            continue
        mul = _only_user(s)
        if mul is None or not _is(mul, aten.mul.Tensor):
            continue
        up = _other(mul, s)
        if not isinstance(up, fx.Node):
            continue
        _replace_with(gm, mul, torch.ops.adstore.silu_mul.default, (s.args[0], up))
        count += 1
    return _finish(gm, count)


def _slice_of(node: Any) -> tuple[fx.Node, int, int, int] | None:
    """``slice(x, dim, start, end)`` -> (x, dim, start, end)."""
    if not _is(node, aten.slice.Tensor) or len(node.args) < 4:
        return None
    x, dim, start, end = node.args[:4]
    if not isinstance(x, fx.Node) or not all(isinstance(v, int) for v in (dim, start, end)):
        return None
    return x, dim, start, end


def _last_dim(x: fx.Node) -> int | None:
    val = x.meta.get("val")
    shape = getattr(val, "shape", None)
    if shape is None or not isinstance(shape[-1], int):
        return None
    return int(shape[-1])


def rewrite_rope(gm: fx.GraphModule) -> int:
    """``x * cos + cat(-x[..., h:], x[..., :h]) * sin`` -> ``adstore.rope(x, cos, sin)``."""
    count = 0
    for cat in list(gm.graph.nodes):
        if not _is(cat, aten.cat.default) or len(cat.args[0]) != 2:
            continue
        size = None
        neg, first = cat.args[0]
        if not _is(neg, aten.neg.default):
            continue
        hi, lo = _slice_of(neg.args[0]), _slice_of(first)
        if hi is None or lo is None or hi[0] is not lo[0]:
            continue
        x = hi[0]
        size = _last_dim(x)
        cat_dim = cat.args[1] if len(cat.args) > 1 else 0
        if size is None or size % 2 or x.meta["val"].dim() == 0:
            continue
        ndim = x.meta["val"].dim()
        half = size // 2
        if {hi[1] % ndim, lo[1] % ndim, cat_dim % ndim} != {ndim - 1}:
            continue
        if lo[2] != 0 or lo[3] != half or hi[2] != half or hi[3] < size:
            continue
        mul_sin = _only_user(cat)
        if mul_sin is None or not _is(mul_sin, aten.mul.Tensor):
            continue
        sin = _other(mul_sin, cat)
        add = _only_user(mul_sin)
        if not isinstance(sin, fx.Node) or add is None or not _is(add, aten.add.Tensor):
            continue
        mul_cos = _other(add, mul_sin)
        if not _is(mul_cos, aten.mul.Tensor) or _other(mul_cos, x) is None:
            continue
        cos = _other(mul_cos, x)
        if not isinstance(cos, fx.Node) or add.args[0] is not mul_cos:
            continue  # keep the reference's operand order (x*cos first) for bit-identical sums
        if mul_sin.args[0] is not cat or mul_cos.args[0] is not x:
            continue
        _replace_with(gm, add, torch.ops.adstore.rope.default, (x, cos, sin))
        count += 1
    return _finish(gm, count)


@dataclass(kw_only=True)
class PatternConfig(TransformConfig):
    require_match: bool = False


class _Rewrite(Transform):
    stage = Stage.PATTERN_MATCHING
    config_cls = PatternConfig

    def rewrite(self, gm: fx.GraphModule) -> int:
        raise NotImplementedError

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        if module is None:
            raise IntegrationError(f"{self.name} needs an exported module")
        total = sum(self.rewrite(gm) for _, gm in graph_modules(module))
        if total == 0 and self.config.require_match:  # type: ignore[attr-defined]
            raise IntegrationError(f"{self.name}: pattern not found")
        ctx.info[self.name] = {"matches": total, "applied": total > 0}
        if total:
            log.debug("%s: %d matches", self.name, total)
        else:
            # Said out loud: a user must not assume a rewrite applied that did not.
            log.warning(
                "%s matched nothing in %s: this architecture's variant is not one the rewrite "
                "reproduces bit for bit; the graph is left as exported",
                self.name,
                ctx.factory.config.get("model_type", "the model"),
            )
        return module


class MatchRMSNorm(_Rewrite):
    name = "match_rms_norm"
    code_modules = ("adstore.integration.reference.ops",)

    def rewrite(self, gm: fx.GraphModule) -> int:
        return rewrite_rms_norm(gm)


class MatchSwiGLU(_Rewrite):
    name = "match_swiglu"
    code_modules = ("adstore.integration.reference.ops",)

    def rewrite(self, gm: fx.GraphModule) -> int:
        return rewrite_swiglu(gm)


class MatchRoPE(_Rewrite):
    name = "match_rope"
    code_modules = ("adstore.integration.reference.ops",)

    def rewrite(self, gm: fx.GraphModule) -> int:
        return rewrite_rope(gm)
