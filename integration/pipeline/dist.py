"""Collective agreement between ranks over ``torch.distributed``.

Every helper is a collective: all ranks must call it in the same order, which
is why the cache computes a local outcome first and only then agrees, even
when its own step failed.  Without an initialised process group every helper
is a local no-op, so the same code serves one process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Topology", "agree_int", "all_true", "barrier", "broadcast_int", "is_distributed", "topology"]

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


def _reduce(value: int, op: dist.ReduceOp.RedOpType) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=op)
    return int(t.item())


def all_true(flag: bool) -> bool:
    """True only if ``flag`` is true on every rank."""
    if not is_distributed():
        return bool(flag)
    return _reduce(1 if flag else 0, dist.ReduceOp.MIN) == 1


def agree_int(value: int | None) -> int | None:
    """``value`` if every rank holds the same non-None value, else None."""
    if not is_distributed():
        return value
    v = -1 if value is None else int(value)
    lo = _reduce(v, dist.ReduceOp.MIN)
    hi = _reduce(v, dist.ReduceOp.MAX)
    return value if lo == hi and v >= 0 else None


def broadcast_int(value: int, src: int = 0) -> int:
    """Rank ``src``'s ``value`` on every rank."""
    if not is_distributed():
        return value
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.broadcast(t, src=src)
    return int(t.item())


def barrier() -> None:
    if is_distributed():
        dist.barrier()
