"""``InferenceOptimizer``: runs registered transforms by stage, restoring from the cache point first.

Config shape::

    {
      "model": {"arch": "llama", "layers": 2, "hidden": 64},      # ModelFactory.from_config
      "checkpoint": "/path/to/safetensors/dir",
      "transforms": {"build_model": {}, "export_to_gm": {"seq": 8}, ...,
                     "pipeline_cache": {"stage": "sharding"}, "load_weights": {}, ...},
    }

Names are looked up in a :class:`TransformRegistry` (default: the reference
pipeline's, :func:`default_registry`).  Transforms run sorted by stage (stable
within a stage); a :class:`CachePoint` runs at the end of its stage.  Before
anything runs the optimizer deep-copies the parsed configs: that copy, not the
live configs a transform may mutate, is what the cache key hashes.  With a
cache point the optimizer binds the prefix to it, asks it to restore first and
on a hit resumes at the transform right after it; on a miss it calls its
``save`` at the point (docs/pipeline-cache.md, "The CachePoint protocol").
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from adstore.integration.coordination.dist import topology
from adstore.integration.coordination.events import CacheEvent
from adstore.integration.pipeline.transforms import (
    AfterPoint,
    CachePoint,
    ModelSource,
    PipelineContext,
    Transform,
    TransformRegistry,
)
from adstore.integration.validity.keys import CacheKey
from adstore.store import ConfigError

__all__ = ["InferenceOptimizer", "default_registry", "register_transform"]

log = logging.getLogger(__name__)

_default_registry: TransformRegistry | None = None


def default_registry() -> TransformRegistry:
    """The registry of optimizers given none: the reference transforms plus what :func:`register_transform` added."""
    global _default_registry
    if _default_registry is None:
        from adstore.integration.reference.pipeline import reference_registry

        _default_registry = reference_registry()
    return _default_registry


def register_transform(cls: type[Transform]) -> type[Transform]:
    """Add a transform class to :func:`default_registry` (same name: yours replaces it)."""
    return default_registry().add(cls)


class InferenceOptimizer:
    """Build, transform and (optionally) cache one model for one rank."""

    def __init__(
        self,
        factory: ModelSource,
        checkpoint: str | Path,
        transforms: Mapping[str, Mapping[str, Any] | None] | None = None,
        *,
        registry: TransformRegistry | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        topo = topology(rank, world_size)
        self.factory = factory
        self.ctx = PipelineContext(
            factory=factory, checkpoint=Path(checkpoint), rank=topo.rank, world_size=topo.world_size
        )
        if transforms is None:
            from adstore.integration.reference.pipeline import DEFAULT_TRANSFORMS

            transforms = DEFAULT_TRANSFORMS
        specs = transforms
        registry = default_registry() if registry is None else registry
        if not isinstance(specs, Mapping):
            raise ConfigError("transforms", "expected a mapping of transform name -> options")
        built: list[tuple[int, int, int, Transform]] = []
        for index, (name, opts) in enumerate(specs.items()):
            cls = registry.get(name)
            config = cls.config_cls.from_dict(opts, owner=f"transforms.{name}")
            t = cls(config)
            if isinstance(t, CachePoint):
                built.append((int(t.cache_stage), 1, index, t))
            else:
                built.append((int(cls.stage), 0, index, t))
        built.sort(key=lambda item: item[:3])
        self.transforms: list[Transform] = [t for *_, t in built]
        caches = [t for t in self.transforms if isinstance(t, CachePoint) and t.config.enabled]
        if len(caches) > 1:
            raise ConfigError("transforms.pipeline_cache", "at most one cache point")
        self.cache: CachePoint | None = caches[0] if caches else None
        # The copy the cache key hashes: taken before any transform can mutate a config.
        self._cache_key_config = [(t.name, copy.deepcopy(t.config.to_dict())) for t in self.transforms]
        self.timings: dict[str, float] = {}
        self.resumed_at: str | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **kwargs: Any) -> InferenceOptimizer:
        unknown = set(config) - {"model", "checkpoint", "transforms"}
        if unknown:
            raise ConfigError(min(unknown), "unknown top-level option; allowed: model, checkpoint, transforms")
        if "checkpoint" not in config:
            raise ConfigError("checkpoint", "required")
        from adstore.integration.reference.models import ModelFactory

        return cls(
            ModelFactory.from_config(config.get("model", {})), config["checkpoint"], config.get("transforms"), **kwargs
        )

    @property
    def events(self) -> list[CacheEvent]:
        """What the caches did, in pipeline order: the cache point's events, then those of later stages.

        A transform reports events by holding an ``events`` list (the compile
        stage: its engine's hit, miss, save or bypass).
        """
        out = list(self.cache.events) if self.cache is not None else []
        for t in self.transforms:
            if t is not self.cache:
                out.extend(getattr(t, "events", None) or ())
        return out

    @property
    def info(self) -> dict[str, Any]:
        return self.ctx.info

    def _cache_index(self) -> int | None:
        if self.cache is None:
            return None
        return self.transforms.index(self.cache)

    def _bind_cache(self) -> None:
        idx = self._cache_index()
        if idx is None or self.cache is None:
            return
        prefix = [t for t in self.transforms[:idx] if t.config.enabled]
        names = {t.name for t in prefix}
        self.cache.bind([(n, c) for n, c in self._cache_key_config[:idx] if n in names], [type(t) for t in prefix])

    def _after_point(self, idx: int) -> AfterPoint:
        """What the transforms after the cache point may know of it."""
        assert self.cache is not None
        try:
            key: str | None = self.cache.key(self.ctx).key
        except Exception as exc:  # the cache point reports its own key errors
            log.debug("no cache key for the stages after the point: %s", exc)
            key = None
        cfg = self.cache.config
        later = [
            (name, config, type(t))
            for t, (name, config) in zip(self.transforms[idx + 1 :], self._cache_key_config[idx + 1 :], strict=True)
            if t.config.enabled
        ]
        return AfterPoint(
            key=key,
            snapshot=getattr(self.cache, "snapshot", None),
            root=getattr(cfg, "root", None),
            remote=getattr(cfg, "remote", None),
            transforms=later,
        )

    def cache_key(self) -> CacheKey | None:
        """This run's cache key (None without an enabled cache point); may raise."""
        if self.cache is None:
            return None
        self._bind_cache()
        return self.cache.key(self.ctx)

    def __call__(self) -> nn.Module:
        t_start = time.perf_counter()
        module: nn.Module | None = None
        start = 0
        idx = self._cache_index()
        if idx is not None and self.cache is not None:
            self._bind_cache()
            t0 = time.perf_counter()
            restored = self.cache.restore(self.ctx)
            self.timings["restore"] = time.perf_counter() - t0
            self.ctx.point = self._after_point(idx)
            if restored is not None:
                module, start = restored, idx + 1
                self.resumed_at = self.transforms[start].name if start < len(self.transforms) else None
        module = self._run(module, start)
        self.timings["total"] = time.perf_counter() - t_start
        if module is None:
            raise ConfigError("transforms", "the pipeline produced no module (is build_model missing?)")
        return module

    def _run(self, module: nn.Module | None, start: int) -> nn.Module | None:
        prefix_t0 = time.perf_counter()
        for i in range(start, len(self.transforms)):
            t = self.transforms[i]
            if not t.config.enabled:
                continue
            t0 = time.perf_counter()
            if t is self.cache:
                module = self.cache.save(module, self.ctx, prefix_seconds=t0 - prefix_t0)  # type: ignore[arg-type]
                if self.ctx.point is not None:
                    self.ctx.point.snapshot = getattr(self.cache, "snapshot", None)
            else:
                module = t.apply(module, self.ctx)
            self.timings[t.name] = time.perf_counter() - t0
        return module
