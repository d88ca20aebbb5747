"""How processes and hosts agree about one entry: the coordination every cache tier of the integration shares.

``events`` is what a cache reports, ``dist`` the agreement between the ranks
of one job (one rank decides, the others follow), ``remote`` the process's
client of the remote tier and the flights of a compile stage, ``flights`` the
single-flight of the entries ``enable()`` and the vLLM plugin write.  The
pipeline cache, the engine cache, ``enable()`` and the vLLM plugin all use
them, so they live below those, above only :mod:`adstore.integration.validity`.

Names are imported on first use: importing this package does not import torch.
"""

from adstore.store import lazy_exports

_EXPORTS = {"coordination.events": ("CacheEvent", "EventKind", "Source")}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
