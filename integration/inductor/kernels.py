"""Which files on disk an Inductor cache entry needs: the kernels it loaded and the precompiled header.

An FX-graph cache entry holds the graph's Python wrapper, not its kernels:
on a hit Inductor loads the wrapper, which loads each C++ kernel's shared
object from the cache directory, compiling it when absent (seconds each).
So the adapter watches two of Inductor's own steps while it is enabled and
stores the files they name with the entries:

* ``CppCodeCache._load_library(path, key)``: the ``.so`` of a kernel (and its
  ``.cpp`` and ``.o`` next to it) whenever one is loaded; an FX-graph entry
  takes the kernels loaded between its lookup and its save (one compile);
* ``codecache._precompile_header(...)``: the precompiled C++ header (about
  150 MB, under ``$TMPDIR/torchinductor_$USER/precompiled_headers``) that
  every kernel compile needs; settled only when a kernel is really built
  (:mod:`~adstore.integration.inductor.header`), not on every kernel load.

The header belongs to the toolchain, not to a graph: it travels in one
entry per toolchain (with the answers to Inductor's ISA probes,
:mod:`~adstore.integration.placement.probes`), which
:func:`~adstore.integration.inductor.plug.enable` restores in the background
while Dynamo traces; Inductor's header step waits for it
(:attr:`Recorder.before_toolchain`).  Apart from settling the header only
for a build, the watch only records paths; it never changes what Inductor does.
A kernel an earlier graph of the same process loaded already is not loaded
again, so it travels with that earlier graph's entry only.
GPU kernels (Triton) are bundled into the FX-graph entry by Inductor itself
(``bundle_triton_into_fx_graph_cache``); no GPU here, that path is untested.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from adstore.integration.inductor.header import Deferral
from adstore.integration.inductor.header import install as install_deferral

__all__ = ["Recorder", "RECORDER", "kernel_files", "headers_deferred"]

#: Suffixes of the files a loaded ``.so`` comes with (same stem, same directory).
_SIBLINGS = (".cpp", ".o")


def kernel_files(so_path: str) -> list[str]:
    """``so_path`` and the source and object files of the same stem that exist beside it."""
    stem = so_path[: -len(".so")] if so_path.endswith(".so") else so_path
    return [so_path, *(p for p in (stem + s for s in _SIBLINGS) if os.path.isfile(p))]


class Recorder:
    """The paths Inductor loaded kernels and headers from while the watch was installed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kernels: list[str] = []
        self.headers: dict[str, None] = {}
        self._undo: list[Callable[[], None]] = []
        #: Called before Inductor's header step (the toolchain restore's wait); never raises.
        self.before_toolchain: Callable[[], None] | None = None
        #: The headers deferred while installed (:mod:`~adstore.integration.inductor.header`).
        self.deferral: Deferral | None = None

    # -- what was seen ------------------------------------------------------
    def mark(self) -> int:
        """A position in the kernel log: :meth:`since` returns what was loaded after it."""
        with self._lock:
            return len(self._kernels)

    def since(self, mark: int) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(self._kernels[mark:]))

    def toolchain_files(self) -> list[str]:
        """The precompiled header files seen so far (each header and its ``.gch``)."""
        with self._lock:
            return [f for h in self.headers for f in (h, h + ".gch") if os.path.isfile(f)]

    # -- the watch ------------------------------------------------------------
    def install(self) -> None:
        """Wrap Inductor's two steps; each piece that this torch lacks is skipped."""
        if self._undo:
            return
        from torch._inductor import codecache

        rec = self

        base = getattr(codecache, "CppCodeCache", None)
        original = base.__dict__.get("_load_library") if base is not None else None
        if isinstance(original, classmethod):
            load = original.__func__

            def _load_library(cls: Any, path: str, key: str) -> Any:
                lib = load(cls, path, key)
                rec._note_kernel(path)
                return lib

            base._load_library = classmethod(_load_library)  # type: ignore[union-attr]
            self._undo.append(lambda: setattr(base, "_load_library", original))

        header_fn = getattr(codecache, "_precompile_header", None)
        if callable(header_fn):

            def settle(*args: Any, **kwargs: Any) -> Any:
                rec._await_toolchain()
                path = header_fn(*args, **kwargs)
                if isinstance(path, str):
                    with rec._lock:
                        rec.headers[path] = None
                return path

            self.deferral = _defer(codecache, settle, header_fn, self._undo)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.deferral = None

    def _await_toolchain(self) -> None:
        wait = self.before_toolchain
        if wait is not None:
            wait()

    def _note_kernel(self, path: str) -> None:
        files = kernel_files(path)
        with self._lock:
            self._kernels.extend(files)


def _defer(
    codecache: Any, settle: Callable[..., Any], header_fn: Callable[..., Any], undo: list[Callable[[], None]]
) -> Deferral:
    """Inductor's header step deferred to the first build (:mod:`.header`); each undo goes to ``undo``."""
    directory = getattr(codecache, "_HEADER_DIR", None)
    deferral = Deferral(settle, directory if isinstance(directory, str) else tempfile.gettempdir())
    install_deferral(codecache, deferral, undo)

    def _precompile_header(*args: Any, **kwargs: Any) -> Any:
        return deferral.header(*args, **kwargs)

    codecache._precompile_header = _precompile_header
    undo.append(lambda: setattr(codecache, "_precompile_header", header_fn))
    return deferral


@contextmanager
def headers_deferred() -> Iterator[None]:
    """The header deferred for one load outside :func:`~.plug.enable` (which defers it for the whole process).

    A caller that loads stored kernels itself (the compile stage's
    ``torch_compile`` restore) would otherwise have Inductor settle the
    ~150 MB precompiled header that no placed kernel needs.  Inductor's load
    waits for its kernels before it returns, so no build of that load is
    left with a placeholder once the block ends.
    """
    from torch._inductor import codecache

    header_fn = getattr(codecache, "_precompile_header", None)
    if RECORDER.deferral is not None or not callable(header_fn):
        yield
        return
    undo: list[Callable[[], None]] = []
    try:
        _defer(codecache, header_fn, header_fn, undo)
        yield
    finally:
        while undo:
            undo.pop()()


#: The process's one recorder (Inductor's classes are process-wide too).
RECORDER = Recorder()
