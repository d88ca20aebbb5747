"""The transform pipeline and its cache point (README, "The pipeline cache").

``transforms`` is the framework (stages, typed configs, registry, the
``CachePoint`` protocol), ``optimizer`` runs it, ``cache`` is the
``pipeline_cache`` transform, ``keys`` its cache keys, ``dist`` the rank
agreement and ``events`` what a cache reports.
"""

from adstore.integration._lazy import lazy_exports

_EXPORTS = {
    "InferenceOptimizer": "adstore.integration.pipeline.optimizer",
    "default_registry": "adstore.integration.pipeline.optimizer",
    "register_transform": "adstore.integration.pipeline.optimizer",
    "CachePoint": "adstore.integration.pipeline.transforms",
    "PipelineContext": "adstore.integration.pipeline.transforms",
    "Stage": "adstore.integration.pipeline.transforms",
    "Transform": "adstore.integration.pipeline.transforms",
    "TransformConfig": "adstore.integration.pipeline.transforms",
    "TransformRegistry": "adstore.integration.pipeline.transforms",
    "PipelineCache": "adstore.integration.pipeline.cache",
    "PipelineCacheConfig": "adstore.integration.pipeline.cache",
    "CacheEvent": "adstore.integration.pipeline.events",
    "EventKind": "adstore.integration.pipeline.events",
    "Source": "adstore.integration.pipeline.events",
    "CacheKey": "adstore.integration.pipeline.keys",
    "build_key": "adstore.integration.pipeline.keys",
    "diff_components": "adstore.integration.pipeline.keys",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
