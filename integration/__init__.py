"""The torch side of adstore: the pipeline cache, snapshots and the engine cache.

This is the public API the docs use (docs/pipeline-cache.md, "Public API";
docs/snapshots.md; docs/engine-cache.md): ``cached_prefix`` and the
fingerprint helpers cache any pipeline; ``PipelineCache`` is the cache point
any optimizer drives through the ``CachePoint`` protocol.  Names are imported on first
use, so ``import adstore.integration`` does not import torch.
"""

from adstore.store import lazy_exports

_EXPORTS = {
    "pipeline.prefix": ("CachedCompile", "CachedPrefix", "cached_prefix"),
    "pipeline.fingerprints": ("checkpoint_fingerprint",),
    "pipeline.keys": ("environment_fingerprint",),
    "pipeline.transforms": ("CachePoint", "PipelineContext"),
    "pipeline.cache": ("PipelineCache",),
    "pipeline.optimizer": ("InferenceOptimizer", "register_transform"),
    "pipeline.events": ("CacheEvent", "EventKind"),
    "reference.models": ("ModelFactory",),
    "reference.checkpoint": ("write_random_checkpoint",),
    "reference.pipeline": ("default_transforms",),
    "snapshot.codec": ("dump_module", "load_module"),
    "snapshot.targets": ("allow_prefix",),
    "snapshot.hooks": ("register_hook_type",),
    "engine.cache": ("EngineCache", "compile"),
    "engine.storage": ("EngineStorage", "MemoryEngineStorage", "StoreEngineStorage"),
}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
