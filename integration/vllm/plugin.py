"""The vLLM general plugin: ``register()`` puts every vLLM process's ``torch.compile`` caches in adstore.

vLLM loads the entry points of the group ``vllm.general_plugins`` in each
process it runs model code in (the API server or the ``LLM`` caller, the
engine core, every worker) through ``vllm.plugins.load_general_plugins``, and
calls each one; ``VLLM_PLUGINS`` (comma-separated names) restricts which.  The
compiles happen in the engine core (its workers on multi-GPU hosts), a
process the user never gets to call ``enable()`` in, so a plugin is the one
place that reaches them.

vLLM also calls it in the subprocess that inspects a model class
(``python -m vllm.model_executor.models.registry``, run while its
``modelinfos`` cache lacks the class): that process imports the class and
compiles nothing, so ``register()`` returns there at once.

``register()`` therefore does the least that works everywhere: it primes
torch's source key from this host's record (:mod:`adstore.integration.validity.torchkey`),
enables :mod:`adstore.integration.inductor` with the store ``ADSTORE_ROOT`` and
``ADSTORE_REMOTE*`` name, and installs :mod:`adstore.integration.vllm.hooks`
on that store (vLLM's own compile directories as tree entries).  It is idempotent (vLLM may load plugins more than
once in a process), leaves an ``enable()`` the process made itself alone,
does nothing when ``ADSTORE_VLLM=0``, and never raises: whatever goes wrong is
one log line, and vLLM compiles as it would without adstore.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["register", "ENV_SWITCH"]

logger = logging.getLogger(__name__)

#: ``ADSTORE_VLLM=0`` (or false/no/off) turns the plugin off without uninstalling it.
ENV_SWITCH = "ADSTORE_VLLM"
_OFF = frozenset({"0", "false", "no", "off"})

#: vLLM's model-inspection subprocess runs this module as ``__main__``.
INSPECTION_MAIN = "vllm.model_executor.models.registry"

_lock = threading.Lock()
#: The pid that registered: a process forked from it (vLLM may fork workers) registers again.
_registered_pid: int | None = None


def register() -> None:
    """Called by vLLM in every process: enable adstore for Inductor's caches, once; never raises."""
    global _registered_pid
    if os.environ.get(ENV_SWITCH, "").strip().lower() in _OFF or _main_module() == INSPECTION_MAIN:
        return
    try:
        with _lock:
            if _registered_pid == os.getpid():
                return
            _registered_pid = os.getpid()  # one attempt per process, even a failed one: one log line
            _enable()
    except Exception as exc:  # noqa: BLE001 - fail open: vLLM must start whatever adstore's state
        logger.warning("adstore: vLLM runs without adstore in pid %d (%s: %s)", os.getpid(), type(exc).__name__, exc)


def _main_module() -> str | None:
    """The module name ``__main__`` was run as (``python -m NAME``); None for a script or an interpreter."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    return name if isinstance(name, str) else None


def _enable() -> None:
    from adstore.integration import inductor

    # enable() takes torch's source hash from this host's record (0.6 s of CPU otherwise in each of vLLM's
    # processes, asked for by adstore's keys, vLLM's compile hash and Inductor's keys).
    if inductor.active() is None:
        # inductor.enable() logs its own line (the reason) and returns False when no store opens.
        if not inductor.enable():
            return
        entries = inductor.active()
        if entries is not None:
            entries.store.count({"vllm.plugin_enabled": 1})
    entries = inductor.active()
    if entries is not None:
        from adstore.integration.vllm import hooks

        hooks.install(entries.store)  # vLLM's own compile directories, through the same store; fails open
    logger.info("adstore: vLLM's torch.compile caches go through adstore (pid %d)", os.getpid())
