"""Custom operators the reference pipeline rewrites graphs into.

They live in the ``adstore`` torch.library namespace so that a graph node's
target is ``torch.ops.adstore.<name>.default``: an importable qualified name
that the snapshot allow-list accepts, and that resolves again once this module
is imported.  Every op has a fake (meta) implementation so graphs holding them
still export, shape-propagate and run on the meta device before weights exist.

The collective ops wrap ``torch.distributed`` and degrade to a copy when no
process group is initialised, so a sharded graph also runs in one process.

They are defined with ``torch.library.Library`` (a schema, one
CompositeExplicitAutograd kernel, a fake kernel), not ``torch.library.custom_op``:
a ``custom_op`` kernel is wrapped to keep dynamo out, and that wrapper imports
``torch._dynamo`` on its first call, about 0.8 s of a restart whose first
forward needs nothing of dynamo.  The ops are for inference: they have no
autograd formula (a backward through them raises, as it did before).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ATEN_DECOMPOSITIONS", "OPS", "all_gather", "all_reduce", "grouped_linear", "rms_norm", "rope", "silu_mul"]

_LIB = torch.library.Library("adstore", "DEF")  # noqa: TOR901 - the ops' home; kept alive by this module


def _define(schema: str, kernel, fake) -> torch._ops.OpOverload:
    """Define ``adstore::<schema>`` with one kernel for every backend and ``fake`` for fake/meta tensors."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"adstore::{name}", fake, lib=_LIB)
    return getattr(torch.ops.adstore, name).default


def _rms_norm(x: Tensor, weight: Tensor, eps: float, weight_offset: float) -> Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    if weight_offset != 0.0:
        return (h * (weight.to(torch.float32) + weight_offset)).to(dtype).contiguous()
    return (weight * h.to(dtype)).contiguous()


# The outputs are contiguous whatever the input layout: Inductor lays out an op's
# inputs as it likes (a split of a fused projection, then transposed, need not
# keep eager's strides) and then checks the strides the fake kernel promised, so
# an output layout that followed the input's would not match.  Each fake kernel
# runs the real arithmetic on fake tensors, so sizes, strides and dtype agree.

#: RMSNorm in float32, scaled by ``weight + weight_offset`` (Gemma uses offset 1).  The arithmetic
#: follows the order of the transformers reference modules (variance of the float32 input, rsqrt,
#: cast back, then scale) so that the rewritten graph stays within float rounding of the eager model.
rms_norm = _define("rms_norm(Tensor x, Tensor weight, float eps, float weight_offset) -> Tensor", _rms_norm, _rms_norm)


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return (torch.nn.functional.silu(gate) * up).contiguous()


#: SwiGLU activation: ``silu(gate) * up`` in one op.
silu_mul = _define("silu_mul(Tensor gate, Tensor up) -> Tensor", _silu_mul, _silu_mul)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).contiguous()


#: Rotary embedding ``x * cos + rotate_half(x) * sin`` (half-split rotation, last dim).  Same
#: arithmetic, in the same order, as the transformers reference, so the rewrite is bit-identical.
rope = _define("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", _rope, _rope)


def _check_grouped(x: Tensor, weight: Tensor, offsets: Tensor) -> None:
    torch._check(
        x.dim() == 2 and weight.dim() == 3 and offsets.dim() == 1,
        lambda: (
            f"grouped_linear needs x (rows, in), weight (groups, out, in), offsets (groups,); got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(offsets.shape)}"
        ),
    )
    torch._check(
        offsets.shape[0] == weight.shape[0] and x.shape[1] == weight.shape[2],
        lambda: (
            f"grouped_linear: {offsets.shape[0]} offsets for {weight.shape[0]} groups, "
            f"input width {x.shape[1]} for weights of width {weight.shape[2]}"
        ),
    )
    torch._check(not offsets.is_floating_point(), lambda: "grouped_linear: offsets must be integers")


def _grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """Rows ``offsets[g-1]:offsets[g]`` of ``x`` through ``linear(., weight[g])``, for each group ``g``.

    Each group is one ``torch.nn.functional.linear`` on exactly the rows routed
    to it, the call transformers' own per-expert loop makes, so the results are
    the same bits; nothing is gathered per row (``batched_mm`` copies a whole
    expert matrix for every routed token).  Rows past the last offset are zero.
    """
    _check_grouped(x, weight, offsets)
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for group, end in enumerate(offsets.tolist()):  # one host sync for the whole op
        if not start <= end <= x.shape[0]:
            raise ValueError(f"grouped_linear: offsets must rise within 0..{x.shape[0]}, got {offsets.tolist()}")
        if end > start:
            out[start:end] = torch.nn.functional.linear(x[start:end], weight[group])
        start = end
    out[start:].zero_()
    return out


def _grouped_linear_fake(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    _check_grouped(x, weight, offsets)
    return x.new_empty((x.shape[0], weight.shape[1]))


#: Grouped GEMM (mixture-of-experts): ``x`` is sorted by group, ``offsets`` are the cumulative row
#: counts per group, ``weight`` is ``(groups, out, in)`` like transformers' fused expert weights.
grouped_linear = _define(
    "grouped_linear(Tensor x, Tensor weight, Tensor offsets) -> Tensor", _grouped_linear, _grouped_linear_fake
)


def _group_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _all_reduce(x: Tensor) -> Tensor:
    """Sum over ranks (row-parallel linear outputs); a copy without a process group."""
    out = x.clone()
    if _group_size() > 1:
        dist.all_reduce(out)
    return out


def _all_reduce_fake(x: Tensor) -> Tensor:
    return x.clone()


all_reduce = _define("all_reduce(Tensor x) -> Tensor", _all_reduce, _all_reduce_fake)


def _all_gather(x: Tensor, dim: int, world_size: int) -> Tensor:
    """Concatenate every rank's shard along ``dim`` (column-parallel outputs).

    ``world_size`` is the topology the graph was sharded for; the fake
    implementation needs it to give the gathered shape without a process group.
    """
    n = _group_size()
    if n == 1:  # contiguous like the gathered result (and the fake kernel)
        return x.clone(memory_format=torch.contiguous_format)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _all_gather_fake(x: Tensor, dim: int, world_size: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * world_size
    return x.new_empty(shape)


all_gather = _define("all_gather(Tensor x, int dim, int world_size) -> Tensor", _all_gather, _all_gather_fake)

#: The compute ops as their ATen arithmetic, for a compiler that lowers them first (collectives have none).
ATEN_DECOMPOSITIONS = {rms_norm: _rms_norm, silu_mul: _silu_mul, rope: _rope}

#: The op overloads this module registers, for code that needs to recognise them.
OPS = {
    "rms_norm": rms_norm,
    "silu_mul": silu_mul,
    "rope": rope,
    "all_reduce": all_reduce,
    "all_gather": all_gather,
    "grouped_linear": grouped_linear,
}
