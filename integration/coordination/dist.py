"""Collective agreement between ranks over ``torch.distributed``.

Every helper is a collective: all ranks must call it in the same order, which
is why the cache computes a local outcome first and only then agrees, even
when its own step failed.  Without an initialised process group every helper
is a local no-op, so the same code serves one process.

The values agreed on are small CPU integers.  A default group whose backend
takes CPU tensors (gloo, or ``cpu:gloo,cuda:nccl``) carries them directly;
under an NCCL-only default group, how inference runs on GPUs, CPU tensors
would fail, so the first agreement creates a gloo group over the same ranks
once (a collective call every rank makes at the same point) and every later
agreement uses it (docs/pipeline-cache.md, "Rank agreement").  Moving the
integers to the GPU instead would tie the cache to a device it has no other
reason to touch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "Topology",
    "agree_int",
    "agreement_group",
    "all_true",
    "barrier",
    "broadcast_int",
    "is_distributed",
    "topology",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def topology(rank: int | None = None, world_size: int | None = None) -> Topology:
    """Explicit values win; else the process group's; else rank 0 of 1."""
    if is_distributed():
        r, n = dist.get_rank(), dist.get_world_size()
        if (rank is not None and rank != r) or (world_size is not None and world_size != n):
            raise ValueError(f"rank/world_size {rank}/{world_size} disagree with the process group {r}/{n}")
        return Topology(r, n)
    return Topology(rank or 0, world_size or 1)


#: The gloo side group made for an NCCL-only default group, by the default group it serves.
_side_groups: dict[object, object] = {}


def _cpu_capable(backend: str) -> bool:
    """Whether a backend string (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``) takes CPU tensors."""
    parts = [p.strip() for p in backend.lower().split(",")]
    return any(p in ("gloo", "mpi", "ucc") or p.startswith("cpu:") for p in parts)


def agreement_group() -> object | None:
    """The process group agreement runs on: ``None`` (the default) or a gloo side group.

    A collective on first use under an NCCL-only default group: every rank must
    call it at the same point, which the agreement helpers guarantee.
    """
    default = dist.group.WORLD
    if _cpu_capable(str(dist.get_backend(default))):
        return None
    group = _side_groups.get(default)
    if group is None:
        log.debug(
            "default process group backend %s takes no CPU tensors: creating a gloo agreement group",
            dist.get_backend(default),
        )
        _side_groups.clear()  # a group of an earlier (destroyed) default group is dead
        group = _side_groups[default] = dist.new_group(backend="gloo")
    return group


def _reduce(values: list[int], op: dist.ReduceOp.RedOpType) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=agreement_group())
    return [int(v) for v in t.tolist()]


def all_true(flag: bool) -> bool:
    """True only if ``flag`` is true on every rank."""
    if not is_distributed():
        return bool(flag)
    return _reduce([1 if flag else 0], dist.ReduceOp.MIN)[0] == 1


def agree_int(value: int | None) -> int | None:
    """``value`` if every rank holds the same non-None value, else None."""
    if not is_distributed():
        return value
    v = -1 if value is None else int(value)
    hi, neg_lo = _reduce([v, -v], dist.ReduceOp.MAX)  # max and min in one collective
    return value if hi == -neg_lo and v >= 0 else None


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank."""
    if not is_distributed():
        return value
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.broadcast(t, src=src, group=agreement_group())
    return int(t.item())


def barrier() -> None:
    if is_distributed():
        dist.barrier(group=agreement_group())
