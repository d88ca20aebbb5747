"""The torch side of adstore: the pipeline cache, snapshots and the engine cache.

This is the public API the README uses (README, "The pipeline cache",
"Snapshots and their safety", "Engine cache").  Names are imported on first
use, so ``import adstore.integration`` does not import torch.
"""

from adstore.integration._lazy import lazy_exports

_EXPORTS = {
    "InferenceOptimizer": "adstore.integration.pipeline.optimizer",
    "register_transform": "adstore.integration.pipeline.optimizer",
    "CacheEvent": "adstore.integration.pipeline.events",
    "ModelFactory": "adstore.integration.reference.models",
    "write_random_checkpoint": "adstore.integration.reference.checkpoint",
    "default_transforms": "adstore.integration.reference.pipeline",
    "dump_module": "adstore.integration.snapshot.codec",
    "load_module": "adstore.integration.snapshot.codec",
    "allow_prefix": "adstore.integration.snapshot.targets",
    "register_hook_type": "adstore.integration.snapshot.hooks",
    "EngineCache": "adstore.integration.engine.cache",
    "compile": "adstore.integration.engine.cache",
    "EngineStorage": "adstore.integration.engine.storage",
    "MemoryEngineStorage": "adstore.integration.engine.storage",
    "StoreEngineStorage": "adstore.integration.engine.storage",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
