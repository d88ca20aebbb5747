"""The transform pipeline and its cache point (docs/pipeline-cache.md).

``transforms`` is the framework (stages, typed configs, registry, the
``CachePoint`` protocol), ``optimizer`` runs it, ``cache`` is the
``pipeline_cache`` transform, ``prefix`` the framework-agnostic
``cached_prefix``, ``protocol`` the save/restore protocol both share.  The
cache keys and what decides an entry's validity are in
:mod:`adstore.integration.validity`; the rank agreement, the remote tier and
the events a cache reports in :mod:`adstore.integration.coordination`.
"""

from adstore.store import lazy_exports

_EXPORTS = {
    "pipeline.optimizer": ("InferenceOptimizer", "default_registry", "register_transform"),
    "pipeline.transforms": (
        "CachePoint",
        "PipelineContext",
        "Stage",
        "Transform",
        "TransformConfig",
        "TransformRegistry",
    ),
    "pipeline.cache": ("PipelineCache", "PipelineCacheConfig"),
    "pipeline.prefix": ("CachedCompile", "CachedPrefix", "cached_prefix"),
    "pipeline.protocol": ("SnapshotCache",),
}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
