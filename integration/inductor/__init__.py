"""``torch.compile``'s own caches in adstore: ``enable()`` once, and every compile of the process uses the store.

Inductor keeps FX-graph, AOTAutograd, autotuning and Dynamo PGO caches per
host, with no budget and no sharing; it also asks a *remote* cache on a local
miss, through a pluggable backend.  :func:`enable` plugs adstore in as that
backend for all of them, so the entries get the store's deduplication,
compression, LRU under a budget, remote tier with signed records, and
``adstore ls/stats/explain/rm`` — and the compiled kernel files an entry
needs travel with it, so a new host compiles no kernel another host built.
Anything wrong with the store or the remote makes Inductor compile as it
would have, with one log line per reason and a counter
(``inductor.failopen.<reason>``).  See ``plug`` (the torch side), ``entries``
(keys and artifacts), ``kernels`` (which files), ``toolchain`` (the toolchain
entry's restore and its one deadline), and :mod:`adstore.integration.placement`
(the rule for files that become code, and the ISA probes).

:func:`aot_compile` is the other way in, for one module: torch's own AOT
artifact of its ``forward`` in the store, so a restart loads it without
Dynamo tracing (``aot``, ``aotkey``, ``aotartifact``).

Names are imported on first use: importing this package does not import torch.
"""

from adstore.store import lazy_exports

_EXPORTS = {
    "inductor.plug": ("enable", "disable", "active"),
    "inductor.entries": ("FAILOPEN", "NAMESPACES"),
    "inductor.aot": ("aot_compile", "AOTModule"),
}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
