"""The reference pipeline: model factory, checkpoint, custom ops, reference transforms, the demo.

README, "The pipeline cache" and "Main job: ``adstore demo``".  ``pipeline``
lists the transforms in stage order; importing any module here registers
nothing with the optimizer.
"""

from adstore.integration._lazy import lazy_exports

_EXPORTS = {
    "ModelFactory": "adstore.integration.reference.models",
    "checkpoint_fingerprint": "adstore.integration.reference.checkpoint",
    "read_checkpoint": "adstore.integration.reference.checkpoint",
    "write_random_checkpoint": "adstore.integration.reference.checkpoint",
    "DEFAULT_TRANSFORMS": "adstore.integration.reference.pipeline",
    "REFERENCE_TRANSFORMS": "adstore.integration.reference.pipeline",
    "default_transforms": "adstore.integration.reference.pipeline",
    "reference_registry": "adstore.integration.reference.pipeline",
    "format_demo": "adstore.integration.reference.demo",
    "run_demo": "adstore.integration.reference.demo",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
