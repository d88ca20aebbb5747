"""vLLM with adstore: a vLLM general plugin that puts ``torch.compile``'s caches of every vLLM process in the store.

Names are imported on first use: importing this package imports neither vLLM nor torch.
"""

from adstore.store import lazy_exports

_EXPORTS = {"vllm.plugin": ("register",)}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
