"""Structural snapshots of pre-weight-loading modules, loaded under a positive allow-list.

docs/snapshots.md, "What a snapshot holds".  ``codec`` dumps, loads and summarises;
``wire`` is the format; ``graph``, ``tree``, ``values`` and ``tensor_meta``
encode and decode; ``targets`` is the allow-list; ``hooks`` and
``hook_builtins`` the load-hook specs.
"""

from adstore.store import lazy_exports

_EXPORTS = {
    "snapshot.codec": (
        "FORMAT",
        "HOOKS_ARTIFACT",
        "MODULE_ARTIFACT",
        "VERSION",
        "dump_module",
        "load_module",
        "summarize",
    ),
    "snapshot.targets": ("allow_prefix", "snapshot_safe"),
    "snapshot.hooks": ("TPShardHook", "register_hook_type"),
    "snapshot.graph": ("STALE_SHAPE_KEY", "is_shape_stale"),
}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
