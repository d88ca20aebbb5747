"""The ``pipeline_cache`` transform: snapshot at the cache point, restore before the prefix.

It is a transform like any other, placed at or before the sharding stage, and
any optimizer drives it through the :class:`~adstore.integration.pipeline.transforms.CachePoint`
protocol (docs/pipeline-cache.md, "The CachePoint protocol"): the optimizer hands it a copy of the prefix
configs taken before any transform ran (so a transform that mutates its config
does not change the key), asks it to restore first, and on a miss runs the
prefix and then calls :meth:`PipelineCache.save`.

The save/restore protocol itself (generations, rank agreement, commit, events,
fail-open handling) is :class:`~adstore.integration.pipeline.protocol.SnapshotCache`,
shared with :func:`~adstore.integration.cached_prefix`; this module only adds
the transform's key recipe and configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from adstore.integration.coordination import remote as remote_tier
from adstore.integration.coordination.dist import Topology
from adstore.integration.coordination.events import CacheEvent
from adstore.integration.pipeline.protocol import NAMESPACE, SnapshotCache
from adstore.integration.pipeline.transforms import PipelineContext, Stage, Transform, TransformConfig
from adstore.integration.validity.fingerprints import checkpoint_fingerprint
from adstore.integration.validity.keys import CacheKey, build_key, environment_fingerprint
from adstore.store import ConfigError

__all__ = ["NAMESPACE", "PipelineCache", "PipelineCacheConfig"]


@dataclass(kw_only=True)
class PipelineCacheConfig(TransformConfig):
    """``stage``: where the cache point sits (end of that stage, at most ``sharding``).

    ``root``: store root (None = ``$ADSTORE_ROOT`` or the XDG cache dir);
    ``extra``: caller data hashed into the key; ``allowed_prefixes``: extra
    importable prefixes a snapshot may name (your own wrapper classes).
    """

    stage: str = "sharding"
    root: str | None = None
    namespace: str = NAMESPACE
    extra: dict = field(default_factory=dict)
    allowed_prefixes: list[str] = field(default_factory=list)
    restore: bool = True
    save: bool = True
    remote: str | None = None  # the remote tier's URL; None: $ADSTORE_REMOTE when the pipeline runs

    def validate(self, owner: str) -> None:
        stage = Stage.parse(self.stage)
        if stage > Stage.SHARDING:
            raise ConfigError(
                f"{owner}.stage",
                f"the cache point must sit at or before sharding and before weight loading, not {stage.name.lower()}",
            )


class PipelineCache(Transform):
    """Snapshot the pre-weight-loading module on a miss; restore it on a hit.

    The optimizer drives it through the :class:`~adstore.integration.pipeline.transforms.CachePoint`
    protocol: :meth:`bind`, :meth:`restore`, :meth:`save`.  The key hashes
    ``ctx.factory.identity()``, the fingerprint of ``ctx.checkpoint``, the bound
    prefix, the world size (when the prefix reaches sharding), the environment
    and ``extra``.
    """

    name = "pipeline_cache"
    stage = Stage.SHARDING
    config_cls = PipelineCacheConfig

    def __init__(self, config: TransformConfig) -> None:
        super().__init__(config)
        cfg: PipelineCacheConfig = config  # type: ignore[assignment]
        self._cache = SnapshotCache(
            label=self.name, root=cfg.root, namespace=cfg.namespace, allowed_prefixes=cfg.allowed_prefixes
        )
        self.events: list[CacheEvent] = self._cache.events
        self._prefix: list[dict[str, Any]] = []
        self._prefix_classes: list[type] = []
        self._reaches_sharding = False
        self._key: CacheKey | None = None

    @property
    def cfg(self) -> PipelineCacheConfig:
        return self.config  # type: ignore[return-value]

    @property
    def cache_stage(self) -> Stage:
        return Stage.parse(self.cfg.stage)

    def bind(self, prefix: Sequence[tuple[str, dict[str, Any]]], prefix_classes: Sequence[type]) -> None:
        """Receive the prefix (names + config copies taken before any transform ran)."""
        self._prefix = [{"name": n, "config": c} for n, c in prefix]
        self._prefix_classes = list(prefix_classes)
        self._reaches_sharding = any(getattr(c, "stage", 0) >= Stage.SHARDING for c in prefix_classes)
        self._key = None

    def key(self, ctx: PipelineContext) -> CacheKey:
        """The cache key of this run (computed once per :meth:`bind`)."""
        if self._key is None:
            self._key = build_key(
                model=ctx.factory.identity(),
                checkpoint=checkpoint_fingerprint(ctx.checkpoint),
                prefix=self._prefix,
                dist={"world_size": ctx.world_size} if self._reaches_sharding else None,
                env=environment_fingerprint(self._prefix_classes),
                extra=self.cfg.extra,
            )
        return self._key

    @property
    def snapshot(self) -> str | None:
        """Digest of this rank's snapshot restored or saved by this run (None: neither happened)."""
        return self._cache.snapshot

    def store(self) -> Any:
        """The store at ``root`` (opened on first use)."""
        return self._cache.store()

    def restore(self, ctx: PipelineContext) -> nn.Module | None:
        """The restored module on a hit on every rank, else None (run the full pipeline)."""
        fetched = remote_tier.prefetch(self, ctx)  # a local miss restored from the remote tier
        return remote_tier.mark(
            self,
            fetched,
            self._cache.restore(lambda: self.key(ctx), _topology(ctx), enabled=self.cfg.enabled and self.cfg.restore),
        )

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        """Run as a plain transform: :meth:`save` without a prefix time."""
        return self.save(module, ctx, prefix_seconds=0.0)  # type: ignore[arg-type]

    def save(self, module: nn.Module, ctx: PipelineContext, *, prefix_seconds: float) -> nn.Module:
        """Save ``module`` at the cache point (on a miss); returns it unchanged.

        ``prefix_seconds`` (what the prefix took) is stored with the entry, so a
        later hit can report the seconds it saved.
        """
        if module is None:
            return module  # type: ignore[return-value]
        self._cache.save(
            module,
            lambda: self.key(ctx),
            _topology(ctx),
            prefix_seconds=prefix_seconds,
            meta={"transforms": [p["name"] for p in self._prefix]},
            enabled=self.cfg.save,
        )
        remote_tier.push(self, ctx)
        return module


def _topology(ctx: PipelineContext) -> Topology:
    return Topology(ctx.rank, ctx.world_size)
