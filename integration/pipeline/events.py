"""Structured cache events: what the pipeline cache did, and why.

Each event is counted in the store (``store.record``) and kept on the
optimizer (``optimizer.events``) so callers and tests read outcomes from data,
not from log lines.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["EVENT_KINDS", "CacheEvent"]

#: hit: restored; miss: not restorable (reason); bypass: cache skipped on
#: purpose or by failure (reason); save: an entry was committed.
EVENT_KINDS = ("hit", "miss", "bypass", "save")


@dataclass
class CacheEvent:
    kind: str
    reason: str | None = None
    key: str | None = None
    rank: int = 0
    world_size: int = 1
    seconds: float = 0.0
    seconds_saved: float = 0.0
    bytes: int = 0
    detail: str = ""
    at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown cache event kind {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
