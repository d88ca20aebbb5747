"""Run a function on a module once it is imported (at once if it already is), without importing it.

Two users: the vLLM hooks wrap functions of vLLM modules that most of vLLM's
processes never import (the ``LLM`` caller and the engine core compile
nothing, and ``vllm.compilation.backends`` alone costs about 0.3 s to
import), and ``ADSTORE_ENABLE=1`` (:mod:`adstore.integration.autoenable`)
enables adstore when a program imports torch's compiler, which most Python
processes never do.  Importing a module to patch it would make every process
pay for what one uses, so :func:`when_imported` waits for the program to
import it itself.

A module not imported yet is watched by one finder at the front of
``sys.meta_path``: it asks the finders after it for the module's spec, as
the import system would, and gives that spec's loader (a fresh instance per
module for source files) an ``exec_module`` that runs the original and then
the callbacks; the spec is otherwise the one those finders returned.  The
finder leaves ``sys.meta_path`` once nothing is watched.  A callback that
raises is logged and swallowed: it never fails the program's import.
"""

from __future__ import annotations

import sys
from _thread import allocate_lock

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (see autoenable.py)

if TYPE_CHECKING:  # the module is imported at every interpreter start under ADSTORE_ENABLE=1: stdlib-light
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

    Callback = Callable[[ModuleType], None]

__all__ = ["when_imported", "watched"]

_lock = allocate_lock()
_waiting: dict[str, list[Callback]] = {}


class _Finder:
    """The watch: finds nothing itself, wraps the loader of a watched module's spec."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in _waiting:
            return None
        spec: ModuleSpec | None = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is not None:
            _watch(spec, fullname)
        return spec

    def invalidate_caches(self) -> None:
        return None


_FINDER = _Finder()


def _watch(spec: ModuleSpec, name: str) -> None:
    loader = spec.loader
    exec_module = getattr(loader, "exec_module", None)
    # A loader that is a class (builtin, frozen) serves every module of its kind: never touched.
    if loader is None or isinstance(loader, type) or exec_module is None:
        return

    def run(module: ModuleType) -> None:
        try:
            exec_module(module)
        finally:
            try:
                del loader.exec_module  # type: ignore[union-attr]  # the instance's own again
            except AttributeError:
                pass
        _fire(name, module)

    try:
        loader.exec_module = run  # type: ignore[union-attr]  # this module's loader instance only
    except (AttributeError, TypeError):  # a loader with __slots__: the module is not watched
        _log("debug", "adstore: cannot watch the import of %s", name)


def _fire(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _waiting.pop(name, [])
        _drop_finder_if_idle()
    for callback in callbacks:
        _call(callback, module)


def _call(callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # noqa: BLE001 - an import never fails because of adstore
        _log("warning", "adstore: a hook on %s failed (%s: %s)", module.__name__, type(exc).__name__, exc)


def _log(level: str, message: str, *args: object) -> None:
    """``logging.getLogger(__name__)``, imported when there is something to say (logging costs milliseconds)."""
    import logging

    getattr(logging.getLogger(__name__), level)(message, *args)


def _drop_finder_if_idle() -> None:
    if not _waiting and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def _imported(name: str) -> ModuleType | None:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return None if module is None or getattr(spec, "_initializing", False) else module


def when_imported(name: str, callback: Callback) -> Callable[[], None]:
    """Call ``callback(module)`` once module ``name`` is imported: now if it is; returns a canceller.

    Never imports ``name``.  The callback runs in the importing thread,
    right after the module's code; its exceptions are logged, not raised.
    """
    module = _imported(name)
    if module is not None:
        _call(callback, module)
        return lambda: None
    with _lock:
        _waiting.setdefault(name, []).append(callback)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)  # type: ignore[arg-type]
    module = _imported(name)  # imported by another thread in between: the finder never saw it
    if module is not None:
        with _lock:
            pending = _waiting.get(name, [])
            ours = callback in pending
            if ours:
                pending.remove(callback)
                if not pending:
                    del _waiting[name]
            _drop_finder_if_idle()
        if ours:
            _call(callback, module)

    def cancel() -> None:
        with _lock:
            pending = _waiting.get(name, [])
            if callback in pending:
                pending.remove(callback)
                if not pending:
                    del _waiting[name]
            _drop_finder_if_idle()

    return cancel


def watched() -> list[str]:
    """The modules some callback still waits for."""
    with _lock:
        return sorted(_waiting)
