"""The engine cache: compile once per architecture, refit the current weights (README, "Engine cache").

``cache`` is the front end (``EngineCache``, ``compile``); ``storage`` the back
ends; ``record`` the stored form; ``hashing`` and ``toolchain`` the
architecture hash; ``runtime`` the weights and refit; ``packages`` the
in-process layer.
"""

from adstore.integration._lazy import lazy_exports

_EXPORTS = {
    "CompiledEngine": "adstore.integration.engine.cache",
    "EngineCache": "adstore.integration.engine.cache",
    "compile": "adstore.integration.engine.cache",
    "default_engine_cache": "adstore.integration.engine.cache",
    "set_default_engine_cache": "adstore.integration.engine.cache",
    "EngineStorage": "adstore.integration.engine.storage",
    "MemoryEngineStorage": "adstore.integration.engine.storage",
    "StoreEngineStorage": "adstore.integration.engine.storage",
    "EngineRecord": "adstore.integration.engine.record",
    "get_hash": "adstore.integration.engine.hashing",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
