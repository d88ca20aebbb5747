"""The engine cache: compile once per architecture, refit the current weights (docs/engine-cache.md).

``cache`` is the front end (``EngineCache``, ``compile``); ``storage`` the back
ends; ``record`` the stored form; ``hashing`` the architecture hash (with the
toolchain's identity, :mod:`adstore.integration.validity.toolchain`);
``runtime`` the weights and refit; ``request`` one export-and-hash; ``packages`` the in-process layer.
"""

from adstore.store import lazy_exports

_EXPORTS = {
    "engine.cache": ("CompiledEngine", "EngineCache", "compile", "default_engine_cache", "set_default_engine_cache"),
    "engine.storage": ("EngineStorage", "MemoryEngineStorage", "StoreEngineStorage"),
    "engine.record": ("EngineRecord",),
    "engine.hashing": ("get_hash",),
}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
