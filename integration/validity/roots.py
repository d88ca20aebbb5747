"""Install roots: paths under them are named relative, so a kernel's name does not depend on the install path.

Inductor names each C++ kernel after its source and the compiler's command
line (``CppCodeCache.load_async``: ``write(main_code, "main.cpp",
extra=...)``), and that line holds the include and library directories of
torch and Python (``-I…/site-packages/torch/include``).  The same venv at
``/opt/venv`` on one host and ``/home/me/venv`` on another therefore looks
for its kernels under other names, finds none of those an entry placed, and
compiles them all again.  ccache's ``base_dir`` answers the same problem for
C compilers: absolute paths under a base are rewritten relative before they
are hashed, so two checkouts share one cache.

While :func:`install` is in effect (``enable()``, and an ``aot_compile``
capture or load through :func:`relocated`), the ``extra`` text of the two
kernel writes of ``load_async`` is hashed with every install root in it
(:func:`host_roots`: torch's package directory, the interpreter's prefixes,
include and library directories and site-packages, Inductor's cache
directory, the temp directory) replaced by the root's name (``${torch}``),
longest root first.  The file is still written, built and loaded under this
host's paths; only its name changes.

Bytes still decide: a path no longer tells one torch from another, so the
kernel's name also holds :func:`bytes_identity`, torch's build key and the
toolchain fingerprint (torch version, commit and C++ ABI, Python version and
ABI, compiler version, instruction sets).  Another torch build, compiler or
Python is another name.

What stays path-dependent: the precompiled header.  Its preprocessed text
holds the headers' absolute paths (``__FILE__`` in torch's inline
functions), so its name and bytes do; it is needed only when a kernel is
really built, and the toolchain entry keeps one per install path
(:mod:`adstore.integration.inductor.toolchain_entry`, which names the path that differs).

A torch whose ``codecache`` has no ``write`` is left alone: names hold paths,
as before.  Nothing here raises into Inductor: a root that cannot be read is
left out (a longer name, at worst a kernel built again).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = [
    "KERNEL_SUFFIXES",
    "RELOCATION",
    "active",
    "bytes_identity",
    "host_roots",
    "install",
    "kernel_extra",
    "relative",
    "relocated",
    "supported",
    "uninstall",
]

logger = logging.getLogger(__name__)

#: The scheme of kernel names: in the key and meta of FX-graph entries whose kernels are named this way.
RELOCATION = "roots/1"
#: The ``write`` suffixes of ``CppCodeCache.load_async``'s two kernel sources (nothing else writes them).
KERNEL_SUFFIXES = frozenset({"main.cpp", "optimized.cpp"})

Roots = tuple[tuple[str, str], ...]


def _sysconfig_roots() -> list[tuple[str, str]]:
    paths = sysconfig.get_paths()
    found = [(name, paths.get(name, "")) for name in ("include", "platinclude", "purelib", "platlib", "stdlib")]
    found.append(("libdir", str(sysconfig.get_config_var("LIBDIR") or "")))
    return [(f"python_{name}", path) for name, path in found]


def _inductor_roots() -> list[tuple[str, str]]:
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return [("inductor_cache", str(cache_dir())), ("inductor_headers", str(getattr(codecache, "_HEADER_DIR", "")))]


def _roots() -> Roots:
    """This process's roots, read now: (name, absolute path), longest path first, each path once."""
    import torch

    found: list[tuple[str, str]] = [("torch", os.path.dirname(os.path.abspath(torch.__file__)))]
    found += _sysconfig_roots()
    found += [
        ("prefix", sys.prefix),
        ("exec_prefix", sys.exec_prefix),
        ("base_prefix", sys.base_prefix),
        ("base_exec_prefix", sys.base_exec_prefix),
    ]
    try:
        found += _inductor_roots()
    except Exception as exc:  # noqa: BLE001 - a root left out: a longer name, never a wrong one
        logger.debug("Inductor's directories as roots: %s", exc)
    found.append(("tmp", tempfile.gettempdir()))
    return normalized(found)


def normalized(found: Sequence[tuple[str, str]]) -> Roots:
    """Absolute, non-root paths only, each once (its first name), longest first (nested roots: the inner one)."""
    seen: dict[str, str] = {}
    for name, path in found:
        path = os.path.normpath(path) if path else ""
        if os.path.isabs(path) and path != os.sep and path not in seen:
            seen[path] = name
    return tuple(sorted(((n, p) for p, n in seen.items()), key=lambda r: (-len(r[1]), r[0])))


@functools.cache
def host_roots() -> Roots:
    """:func:`_roots` once per process (the interpreter's and torch's paths do not move while it runs)."""
    return _roots()


def relative(text: str, roots: Roots | None = None) -> str:
    """``text`` with every root that starts a path in it (after a space, quote, ``=``, ``:``, ``-I``, ``-L``) named.

    A root is replaced only where a whole path component ends after it
    (``/opt/venv`` in ``/opt/venv/include``, not in ``/opt/venv2``).
    """
    roots = host_roots() if roots is None else roots
    if not roots:
        return text
    pattern = _pattern(roots)
    names = {path: name for name, path in roots}
    return pattern.sub(lambda m: "${" + names[m.group(1)] + "}", text)


@functools.lru_cache(maxsize=8)
def _pattern(roots: Roots) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(path) for _, path in roots)  # longest first: the regex takes the first
    return re.compile(rf"(?:^|(?<=[\s'\"=:,(\[])|(?<=-[IL]))({alternatives})(?=[/\s'\",)\]]|$)")


@functools.cache
def bytes_identity() -> str:
    """torch's build key and the toolchain fingerprint in one digest: what a kernel depends on besides its source."""
    from torch._inductor.codecache import torch_key

    from adstore.integration.validity.keys import json_digest
    from adstore.integration.validity.toolchain import toolchain_identity

    return json_digest({"torch_key": torch_key().hex(), "toolchain": toolchain_identity(), "scheme": RELOCATION})


def kernel_extra(extra: str) -> str:
    """What a kernel's name is hashed from in place of ``extra``: its paths relative, its bytes' identity added."""
    return f"{relative(extra)} adstore:{RELOCATION}:{bytes_identity()}"


_lock = threading.Lock()
_installed: list[Any] = []  # [codecache module, original write] while installed
_users = 0


def install() -> bool:
    """Name this process's kernels relative to its roots (counted: each call needs one :func:`uninstall`).

    Returns False, changing nothing, on a torch without ``codecache.write``.
    """
    global _users
    with _lock:
        if _installed:
            _users += 1
            return True
        try:
            from torch._inductor import codecache

            original = codecache.write
        except (ImportError, AttributeError) as exc:
            logger.debug("kernel names keep their paths (no codecache.write): %s", exc)
            return False
        if not callable(original):
            return False
        try:
            host_roots()  # read the roots now, outside Inductor's compile
        except Exception as exc:  # noqa: BLE001 - no roots: names keep their paths
            logger.debug("kernel names keep their paths (roots: %s)", exc)
            return False

        def write(content: Any, extension: Any = None, *args: Any, **kwargs: Any) -> Any:
            if extension in KERNEL_SUFFIXES:
                args, kwargs = _relocated_extra(args, kwargs)
            return original(content, extension, *args, **kwargs)

        codecache.write = write
        _installed[:] = [codecache, original]
        _users = 1
        return True


def _relocated_extra(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``write``'s arguments with ``extra`` (third positional or keyword) relocated; unchanged on any problem."""
    try:
        if "key" in kwargs and kwargs["key"] is not None:
            return args, kwargs  # a name given by the caller: nothing is hashed
        if args:
            if isinstance(args[0], str):
                return (kernel_extra(args[0]), *args[1:]), kwargs
        elif isinstance(kwargs.get("extra", ""), str):
            return args, {**kwargs, "extra": kernel_extra(kwargs.get("extra", ""))}
    except Exception as exc:  # noqa: BLE001 - the name holds the paths, as without adstore: a build, never a wrong kernel
        logger.debug("kernel name keeps its paths: %s", exc)
    return args, kwargs


def uninstall() -> None:
    """Undo one :func:`install`; the last one puts Inductor's ``write`` back."""
    global _users
    with _lock:
        if not _installed:
            return
        _users -= 1
        if _users > 0:
            return
        codecache, original = _installed
        codecache.write = original
        _installed.clear()


def supported() -> bool:
    """Whether this torch's kernel names can be made relative (its ``codecache`` has a ``write`` to wrap)."""
    try:
        from torch._inductor import codecache
    except ImportError:
        return False
    return callable(getattr(codecache, "write", None))


def active() -> bool:
    """Whether this process names its kernels relative to its roots now."""
    return bool(_installed)


@contextmanager
def relocated() -> Iterator[bool]:
    """:func:`install` for the ``with`` block (yields whether it took effect)."""
    took = install()
    try:
        yield took
    finally:
        if took:
            uninstall()
