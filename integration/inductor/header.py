"""Inductor's precompiled header, settled only when a kernel is really built.

Before it looks for a kernel's ``.so``, ``CppCodeCache.load_async`` settles
the precompiled header (``codecache._precompile_header``): a ``g++ -E`` of
the header and an ``openssl sha512`` of its output in every process (about
0.3 s), and the ~150 MB header itself where it is absent.  The header's path
is used only by a build: it is not part of the kernel's key or name, and a
kernel whose ``.so`` is there is loaded without it.  A warm start, whose
kernels all come from Inductor's directory or the store, needs none of it.

So, while adstore is enabled, a header asked for inside ``load_async`` is a
*deferred* one: :meth:`Deferral.placeholder` returns a path that does not
exist, and the header is settled (the real step, which waits for the
toolchain restore and places the stored header: :mod:`.toolchain`) the first
time a build of that call needs it:

* ``CppBuilder.build`` in this process (``TORCHINDUCTOR_COMPILE_THREADS=1``,
  or a build ``load_async`` runs itself), and
* the ``submit_fn`` ``load_async`` hands a build to (the compile workers),
  before the builders are sent.

Both rewrite the builder's ``-include`` to the settled header.  The rewrite
is checked once on a builder of this torch (:func:`rewrites`); a torch whose
builders it cannot rewrite gets the header settled at once, as before.  A
placeholder that reached a compiler anyway names a file that is not there:
the build fails, Inductor compiles without adstore's help, never a wrong kernel.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Deferral", "PLACEHOLDER_PREFIX", "rewrites"]

logger = logging.getLogger(__name__)

#: The file-name prefix of a deferred header's placeholder path (never created).
PLACEHOLDER_PREFIX = "adstore-deferred-header-"
_counter = itertools.count()


def _rewrite(builder: Any, placeholder: str, header: str) -> None:
    """Point ``builder``'s precompiled header (option and ``-include``) from ``placeholder`` to ``header``."""
    option = builder._build_option
    if getattr(option, "precompiled_header", None) == placeholder:
        option.precompiled_header = header
    builder._include_dirs_args = builder._include_dirs_args.replace(placeholder, header)


@functools.cache
def rewrites() -> bool:
    """Whether this torch's ``CppBuilder`` takes :func:`_rewrite` (checked once, on a throwaway builder)."""
    try:
        from torch._inductor.cpp_builder import CppBuilder, CppOptions

        option = CppOptions()
        before, after = "/adstore-check/before.h", "/adstore-check/after.h"
        option.precompiled_header = before
        builder = CppBuilder(name="o", sources="i", BuildOption=option)
        _rewrite(builder, before, after)
        line = builder.get_command_line()
        return after in line and before not in line and builder._build_option.precompiled_header == after
    except Exception as exc:  # noqa: BLE001 - another torch's internals: the header is settled at once
        logger.debug("deferred precompiled header unavailable: %s", exc)
        return False


class Deferral:
    """The headers deferred in this process: placeholder path -> the header step's arguments.

    ``settle(*args, **kwargs)`` is the real header step (returns the header's path).
    """

    def __init__(self, settle: Callable[..., str], directory: str) -> None:
        self._settle = settle
        self._directory = directory
        self._lock = threading.Lock()
        self._local = threading.local()
        self._by_args: dict[Any, str] = {}
        self._pending: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._settled: dict[str, str] = {}

    # -- inside load_async ---------------------------------------------------------
    def inside(self) -> bool:
        """Whether this thread is inside ``load_async`` (where a header may be deferred)."""
        return getattr(self._local, "depth", 0) > 0

    def enter(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def leave(self) -> None:
        self._local.depth = getattr(self._local, "depth", 1) - 1

    def header(self, *args: Any, **kwargs: Any) -> str:
        """The header step as ``load_async`` sees it: a placeholder when deferrable, else the settled header."""
        if not self.inside() or not rewrites():
            return self._settle(*args, **kwargs)
        try:
            key = (args, tuple(sorted(kwargs.items())))
            hash(key)
        except TypeError:
            return self._settle(*args, **kwargs)
        with self._lock:
            found = self._by_args.get(key)
            if found is None:
                found = os.path.join(self._directory, f"{PLACEHOLDER_PREFIX}{os.getpid()}-{next(_counter)}.h")
                self._by_args[key] = found
                self._pending[found] = (args, dict(kwargs))
            return found

    # -- before a build -----------------------------------------------------------------
    def resolve(self, builder: Any) -> None:
        """Settle the headers ``builder`` was given placeholders for, and point it there (no-op otherwise)."""
        line = getattr(builder, "_include_dirs_args", None)
        if not isinstance(line, str) or PLACEHOLDER_PREFIX not in line:
            return
        for placeholder in [p for p in list(self._pending) if p in line]:
            header = self._settled.get(placeholder)
            if header is None:
                args, kwargs = self._pending[placeholder]
                header = self._settle(*args, **kwargs)  # functools.cache'd by Inductor: once per header
                self._settled[placeholder] = header
            _rewrite(builder, placeholder, header)

    def resolve_work(self, work: Any) -> None:
        """Settle the headers of the builders a ``load_async`` work item (``partial(fn, lock, builders)``) holds."""
        for arg in getattr(work, "args", ()):
            for item in arg if isinstance(arg, list | tuple) else (arg,):
                self.resolve(item)

    def submitter(self, submit: Any) -> Any:
        """``submit`` with the work's headers settled here first (the workers never see a placeholder)."""
        if submit is None:
            return None

        def submit_settled(work: Any) -> Any:
            self.resolve_work(work)
            return submit(work)

        return submit_settled

    @property
    def settled(self) -> int:
        """How many deferred headers a build needed so far."""
        return len(self._settled)

    @property
    def deferred(self) -> int:
        """How many headers were deferred so far."""
        return len(self._pending)


def install(codecache: Any, deferral: Deferral, undo: list[Callable[[], None]]) -> None:
    """Wrap ``load_async`` (defer there, settle before a submit) and ``CppBuilder.build`` (settle before a build).

    Each wrapper's undo goes to ``undo``; a piece this torch lacks is skipped
    (without ``load_async``'s wrapper nothing is deferred).
    """
    from torch._inductor import cpp_builder

    base = getattr(codecache, "CppCodeCache", None)
    builder_cls = getattr(cpp_builder, "CppBuilder", None)
    original_load = base.__dict__.get("load_async") if base is not None else None
    original_build = builder_cls.__dict__.get("build") if builder_cls is not None else None
    if not isinstance(original_load, classmethod) or not callable(original_build):
        return
    load = original_load.__func__

    def build(self: Any) -> Any:
        deferral.resolve(self)
        return original_build(self)

    builder_cls.build = build
    undo.append(lambda: setattr(builder_cls, "build", original_build))

    def load_async(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 2:
            args = (*args[:2], deferral.submitter(args[2]), *args[3:])
        elif kwargs.get("submit_fn") is not None:
            kwargs["submit_fn"] = deferral.submitter(kwargs["submit_fn"])
        deferral.enter()
        try:
            return load(cls, *args, **kwargs)
        finally:
            deferral.leave()

    base.load_async = classmethod(load_async)  # type: ignore[union-attr]
    undo.append(lambda: setattr(base, "load_async", original_load))
