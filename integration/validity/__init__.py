"""What decides whether a stored entry is valid here: the room every tier of the integration shares.

An entry may be used only if what made it matches what would make it now:
the canonical digests of its key (``keys``), the fingerprints of the code and
checkpoint behind it (``fingerprints``), the environment check that names the
differing fields (``envcheck``), the toolchain and CPU identity of the host
(``toolchain``, ``cpuid``), torch's own source key (``torchkey``) and the
install roots that make paths portable between hosts (``roots``).  The
pipeline cache, the engine cache, ``enable()`` and the vLLM plugin all ask
the same questions, so the answers live once, below all of them: nothing
here imports another integration subpackage but ``errors``, and the import
contracts in ``pyproject.toml`` keep it so.

Names are imported on first use: importing this package does not import torch.
"""

from adstore.store import lazy_exports

_EXPORTS = {
    "validity.keys": ("CacheKey", "build_key", "diff_components", "environment_fingerprint"),
    "validity.fingerprints": ("checkpoint_fingerprint",),
}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
