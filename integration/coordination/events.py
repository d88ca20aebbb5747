"""Structured cache events: what the pipeline cache or the engine cache did, and why.

One type for both caches (docs/pipeline-cache.md, "Events").
Each event is counted in the store (``Store.count_event``) and kept where the
caller can read it (``optimizer.events``, ``engine.event``), so callers and
tests read outcomes from data, not from log lines.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from adstore.store import Reason

__all__ = ["CacheEvent", "EventKind", "Source"]


class EventKind(enum.StrEnum):
    """What happened: a restore/reuse, a miss (with a reason), a skip on purpose or by failure, a save."""

    HIT = "hit"
    MISS = "miss"
    BYPASS = "bypass"
    SAVE = "save"


class Source(enum.StrEnum):
    """Where the module or engine of an event came from."""

    NONE = "none"  # nothing was produced (a lookup that missed)
    LOCAL = "local"  # restored from the local store
    STORE = "local"  # the same (an alias kept for callers that name it so)
    REMOTE = "remote"  # restored from the remote tier into the local store, then from there
    MEMORY = "memory"  # the engine cache's in-process layer
    BACKEND = "backend"  # the engine storage back end
    COMPILED = "compiled"  # compiled in this call


@dataclass(frozen=True)
class CacheEvent:
    """One cache decision.

    ``key`` is the pipeline cache key or the engine hash (None when it could
    not be computed); ``saved`` says whether a freshly compiled engine was
    written back; ``seconds_saved`` is the estimated time a hit saved;
    ``transferred`` is what a ``remote`` hit downloaded (docs/remote.md).
    """

    kind: EventKind
    reason: Reason | None = None
    key: str | None = None
    source: Source = Source.NONE
    rank: int = 0
    world_size: int = 1
    seconds: float = 0.0
    seconds_saved: float = 0.0
    bytes: int = 0
    saved: bool = False
    transferred: int = 0
    detail: str = ""
    at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", EventKind(self.kind))
        object.__setattr__(self, "source", Source(self.source))
        if self.reason is not None:
            object.__setattr__(self, "reason", Reason(self.reason))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: kinds, sources and reasons as their words."""
        out = dataclasses.asdict(self)
        for name in ("kind", "source", "reason"):
            if out[name] is not None:
                out[name] = str(out[name])
        return out
