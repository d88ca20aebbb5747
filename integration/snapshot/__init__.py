"""Structural snapshots of pre-weight-loading modules, loaded under a positive allow-list.

README, "Snapshots and their safety".  ``codec`` dumps, loads and summarises;
``wire`` is the format; ``graph``, ``tree``, ``values`` and ``tensor_meta``
encode and decode; ``targets`` is the allow-list; ``hooks`` and
``hook_builtins`` the load-hook specs.
"""

from adstore.integration._lazy import lazy_exports

_EXPORTS = {
    "FORMAT": "adstore.integration.snapshot.codec",
    "HOOKS_ARTIFACT": "adstore.integration.snapshot.codec",
    "MODULE_ARTIFACT": "adstore.integration.snapshot.codec",
    "VERSION": "adstore.integration.snapshot.codec",
    "dump_module": "adstore.integration.snapshot.codec",
    "load_module": "adstore.integration.snapshot.codec",
    "summarize": "adstore.integration.snapshot.codec",
    "allow_prefix": "adstore.integration.snapshot.targets",
    "snapshot_safe": "adstore.integration.snapshot.targets",
    "TPShardHook": "adstore.integration.snapshot.hooks",
    "register_hook_type": "adstore.integration.snapshot.hooks",
    "STALE_SHAPE_KEY": "adstore.integration.snapshot.graph",
    "is_shape_stale": "adstore.integration.snapshot.graph",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
