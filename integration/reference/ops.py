"""Custom operators the reference pipeline rewrites graphs into.

They live in the ``adstore`` torch.library namespace so that a graph node's
target is ``torch.ops.adstore.<name>.default``: an importable qualified name
that the snapshot allow-list accepts, and that resolves again once this module
is imported.  Every op has a fake (meta) implementation so graphs holding them
still export, shape-propagate and run on the meta device before weights exist.

The collective ops wrap ``torch.distributed`` and degrade to a copy when no
process group is initialised, so a sharded graph also runs in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["OPS", "all_gather", "all_reduce", "rms_norm", "silu_mul"]


def _rms_norm(x: Tensor, weight: Tensor, eps: float, weight_offset: float) -> Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    if weight_offset != 0.0:
        return (h * (weight.to(torch.float32) + weight_offset)).to(dtype).contiguous()
    return (weight * h.to(dtype)).contiguous()


@torch.library.custom_op("adstore::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, weight_offset: float) -> Tensor:
    """RMSNorm in float32, scaled by ``weight + weight_offset`` (Gemma uses offset 1).

    The arithmetic follows the order of the transformers reference modules
    (variance of the float32 input, rsqrt, cast back, then scale) so that the
    rewritten graph stays within float rounding of the eager model.
    """
    return _rms_norm(x, weight, eps, weight_offset)


# The outputs are contiguous whatever the input layout: Inductor lays out an op's
# inputs as it likes (a split of a fused projection, then transposed, need not
# keep eager's strides) and then checks the strides the fake kernel promised, so
# an output layout that followed the input's would not match.  Each fake kernel
# runs the real arithmetic on fake tensors, so sizes, strides and dtype agree.
rms_norm.register_fake(_rms_norm)


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return (torch.nn.functional.silu(gate) * up).contiguous()


@torch.library.custom_op("adstore::silu_mul", mutates_args=())
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU activation: ``silu(gate) * up`` in one op."""
    return _silu_mul(gate, up)


silu_mul.register_fake(_silu_mul)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).contiguous()


@torch.library.custom_op("adstore::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding ``x * cos + rotate_half(x) * sin`` (half-split rotation, last dim).

    Same arithmetic, in the same order, as the transformers reference, so the
    rewrite is bit-identical to the graph it replaces.
    """
    return _rope(x, cos, sin)


rope.register_fake(_rope)


def _group_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


@torch.library.custom_op("adstore::all_reduce", mutates_args=())
def all_reduce(x: Tensor) -> Tensor:
    """Sum over ranks (row-parallel linear outputs); a copy without a process group."""
    out = x.clone()
    if _group_size() > 1:
        dist.all_reduce(out)
    return out


@all_reduce.register_fake
def _all_reduce_fake(x: Tensor) -> Tensor:
    return x.clone()


@torch.library.custom_op("adstore::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, world_size: int) -> Tensor:
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


@all_gather.register_fake
def _all_gather_fake(x: Tensor, dim: int, world_size: int) -> Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * world_size
    return x.new_empty(shape)


#: The op overloads this module registers, for code that needs to recognise them.
OPS = {
    "rms_norm": torch.ops.adstore.rms_norm.default,
    "silu_mul": torch.ops.adstore.silu_mul.default,
    "rope": torch.ops.adstore.rope.default,
    "all_reduce": torch.ops.adstore.all_reduce.default,
    "all_gather": torch.ops.adstore.all_gather.default,
}
