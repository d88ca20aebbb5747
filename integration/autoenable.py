"""``ADSTORE_ENABLE=1``: every Python process enables adstore by itself when it imports torch's compiler.

``adstore run -- CMD`` sets the variable; an image may set it instead.  The
``adstore-enable.pth`` file the package installs in site-packages runs at
every interpreter start (as ``site`` runs any ``.pth`` line that begins with
``import``); while the variable is unset it reads it and does nothing else,
and when it is on it calls :func:`install`, which imports nothing of torch or
of the store: it asks :func:`~adstore.integration.onimport.when_imported` to
call :func:`activate` when the program imports ``torch._dynamo``.  So
workers of ``multiprocessing`` (spawn and forkserver start a new
interpreter), ``torchrun`` ranks and subprocesses all do it, because the
variable is inherited.

Why ``torch._dynamo``: every compile path starts there (``torch.compile``,
``torch.export`` and what is built on them import it before they compile
anything), ``import torch`` and eager code never import it, and Dynamo imports
``torch._inductor`` while it initializes.  Firing on ``torch._inductor`` would
run :func:`activate` half-way through Dynamo's import; firing on
``torch._dynamo`` runs it once Dynamo's code has run, before its first frame
is traced, which is before any of the flags and backends ``enable()`` sets
is read.

:func:`activate` is ``inductor.enable()`` from the environment
(``ADSTORE_ROOT``, ``ADSTORE_REMOTE*``, ``ADSTORE_SEED``), unless the process
has an enabled store already (its own ``enable()`` or the vLLM plugin's: the
two never enable twice).  Like ``enable()`` it never raises: a store that
cannot be opened is one log line, and torch compiles as it would without
adstore.  ``ADSTORE_ENABLE=0`` (or unset) turns it all off.
"""

from __future__ import annotations

import os

from adstore.integration.onimport import when_imported

#: typing.TYPE_CHECKING without importing typing: this module and its imports run at every interpreter
#: start under ADSTORE_ENABLE=1, so they import nothing but what ``site`` has imported already.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from types import ModuleType

__all__ = ["ENV_SWITCH", "TRIGGER", "activate", "install", "wanted"]

#: The variable ``adstore run`` sets: 1/true/yes/on enables, anything else (0, unset) does not.
ENV_SWITCH = "ADSTORE_ENABLE"
#: The module whose import enables adstore (see the module's docstring for why this one).
TRIGGER = "torch._dynamo"
_ON = frozenset({"1", "true", "yes", "on"})
_installed: list[bool] = []


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ADSTORE_ENABLE`` asks for adstore in this process."""
    env = os.environ if environ is None else environ
    return env.get(ENV_SWITCH, "").strip().lower() in _ON


def install() -> None:
    """Called by ``adstore-enable.pth`` at interpreter start: watch for torch's compiler, once; never raises."""
    if _installed or not wanted():
        return
    _installed.append(True)
    try:
        when_imported(TRIGGER, activate)
    except Exception as exc:  # noqa: BLE001 - the program starts whatever adstore's state
        _warn("adstore: %s=1 ignored in pid %d (%s: %s)", ENV_SWITCH, os.getpid(), type(exc).__name__, exc)


def activate(module: ModuleType | None = None) -> bool:
    """Enable adstore from the environment unless this process has it enabled; never raises.

    Returns whether a store is enabled afterwards.  ``module`` is the
    trigger module (passed by the import watch, unused).
    """
    try:
        from adstore.integration import inductor

        if inductor.active() is not None:
            return True
        if not inductor.enable():  # it logged the reason and counted it, where a store opened
            return False
        entries = inductor.active()
        if entries is not None:
            entries.store.count({"autoenable.enabled": 1})
        return True
    except Exception as exc:  # noqa: BLE001 - fail open: torch compiles as it would without adstore
        _warn("adstore: torch runs without adstore in pid %d (%s: %s)", os.getpid(), type(exc).__name__, exc)
        return False


def _warn(message: str, *args: object) -> None:
    """``logging.getLogger(__name__).warning``, importing logging only when there is something to say."""
    import logging

    logging.getLogger(__name__).warning(message, *args)
