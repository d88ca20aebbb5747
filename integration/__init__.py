"""The torch side of adstore: the pipeline cache, snapshots and the engine cache.

This is the public API the docs use (docs/pipeline-cache.md, "Public API";
docs/snapshots.md; docs/engine-cache.md): ``cached_prefix`` and the
fingerprint helpers cache any pipeline; ``PipelineCache`` is the cache point
any optimizer drives through the ``CachePoint`` protocol.  Names are imported on first
use, so ``import adstore.integration`` does not import torch.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (see autoenable.py)

if TYPE_CHECKING:
    from collections.abc import Callable

_EXPORTS = {
    "pipeline.prefix": ("CachedCompile", "CachedPrefix", "cached_prefix"),
    "validity.fingerprints": ("checkpoint_fingerprint",),
    "validity.keys": ("environment_fingerprint",),
    "pipeline.transforms": ("CachePoint", "PipelineContext"),
    "pipeline.cache": ("PipelineCache",),
    "pipeline.optimizer": ("InferenceOptimizer", "register_transform"),
    "coordination.events": ("CacheEvent", "EventKind"),
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
_resolvers: list[tuple[Callable[[str], object], Callable[[], list[str]]]] = []


def _resolver() -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The package's lazy exports, built on first use: ``ADSTORE_ENABLE=1`` imports a submodule of this
    package at every interpreter start (:mod:`adstore.integration.autoenable`), which must not import the store."""
    if not _resolvers:
        from adstore.store import lazy_exports

        _resolvers.append(lazy_exports(__name__, _EXPORTS, base="adstore.integration"))
    return _resolvers[0]


def __getattr__(name: str) -> object:
    return _resolver()[0](name)


def __dir__() -> list[str]:
    return _resolver()[1]()
