"""The reference pipeline: model factory, checkpoint, custom ops, reference transforms, the demo.

docs/pipeline-cache.md, "The reference pipeline", and docs/cli.md, "adstore demo".  ``pipeline``
lists the transforms in stage order; importing any module here registers
nothing with the optimizer.
"""

from adstore.store import lazy_exports

_EXPORTS = {
    "reference.models": ("ModelFactory",),
    "reference.checkpoint": (
        "checkpoint_fingerprint",
        "read_checkpoint",
        "write_header_checkpoint",
        "write_random_checkpoint",
    ),
    "reference.pipeline": ("DEFAULT_TRANSFORMS", "REFERENCE_TRANSFORMS", "default_transforms", "reference_registry"),
    "reference.demo": ("format_demo", "run_demo"),
}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
