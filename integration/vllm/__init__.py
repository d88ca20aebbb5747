"""vLLM with adstore: a general plugin that puts the compile caches of every vLLM process in the store.

``plugin.register`` (the ``vllm.general_plugins`` entry point) enables the
``torch.compile`` integration and installs ``hooks``, which make vLLM restore
its own compile directories from tree entries (``trees``) before it looks and
capture them after it writes.

Names are imported on first use: importing this package imports neither vLLM nor torch.
"""

from adstore.store import lazy_exports

_EXPORTS = {"vllm.plugin": ("register",)}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
