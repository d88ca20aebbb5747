"""torch's source key remembered per host: a process gets ``torch_key()`` from a record instead of hashing torch.

``torch._inductor.codecache.torch_key()`` is a SHA-256 over the bytes of
every module file of the installed torch (about 2,300 files; 0.6 s of CPU
on the benchmark's 2 shared cores), computed once per process by whoever
asks first: Inductor (every FX-graph and AOTAutograd key holds it), vLLM
(its compile hash) and adstore (every key holds it).  vLLM runs three such
processes per start, and two of them compile nothing.

:func:`prime` keeps the value in a record beside Inductor's own cache
(``<Inductor cache dir>/adstore-torch-key.json``) together with a
*fingerprint* of the files it was computed from: for each module file of
torch's packages (the files ``torch_key`` reads: module suffixes, in
directories with an ``__init__.py``, plus the two files it adds), its
relative path, size, inode, modification and change times; and torch's
path, version and commit.  When the fingerprint of torch as it is now
matches, ``torch_key.set(value)`` gives torch the value before anyone asks
(torch's own way to prepopulate it); otherwise a background thread computes
the value and records it (and gives it to torch, unless torch computed its own
meanwhile).

A record binds a fingerprint to the key of the files that fingerprint
describes, and nothing else: the thread takes the fingerprint *before* it
computes the key, computes it with torch's own function behind its cache
(never the value cached in this process, which may be of files that changed
since: a late or repeated ``enable()``), and takes the fingerprint again
after.  Files that changed in between are no record.

The fingerprint is the rule Python uses for its own bytecode caches (size
and time of the source), made stricter by the inode and the change time,
which no file operation can set back: an edited, reinstalled or replaced
file is a new fingerprint.  The record is read only when the store's one
trust rule accepts it and its directory (``adstore.store.file_refusal`` and
``dir_refusal``, with ``trusted_uids``); anything else,
or a malformed record, is no record.  Nothing here ever raises.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import inspect
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adstore.store import ConfigError, dir_refusal, file_refusal, trusted_uids

__all__ = ["RECORD", "Primed", "fingerprint", "prime", "wait_recorded"]

logger = logging.getLogger(__name__)

#: The record's name in Inductor's cache directory.
RECORD = "adstore-torch-key.json"
_FORMAT = 1
#: Files torch_key reads beside the modules (torch/_inductor/codecache.py, get_code_hash).
_EXTRA = ("_inductor/codegen/aoti_runtime/interface.cpp", "_inductor/script.ld")


@dataclass(frozen=True)
class Primed:
    """What :func:`prime` did: ``status`` (``primed``, ``recording``, ``known``, ``unsupported``, ``error``)."""

    status: str
    detail: str = ""
    thread: threading.Thread | None = None  # ``recording``: the thread that writes the record


def _module_suffixes() -> tuple[str, ...]:
    return tuple(sorted(set(importlib.machinery.all_suffixes()), key=len, reverse=True))


def _walk(directory: str, relative: str, suffixes: tuple[str, ...], out: list[str]) -> None:
    """Every module file of the package ``directory`` and its subpackages (as pkgutil: a package has ``__init__``)."""
    with os.scandir(directory) as it:
        entries = sorted(it, key=lambda e: e.name)
    if relative and not any(e.name in _inits(suffixes) for e in entries):
        return  # not a package: torch_key reads nothing here or below
    for entry in entries:
        name = f"{relative}{entry.name}"
        if entry.is_dir(follow_symlinks=True):
            if entry.name != "__pycache__":
                _walk(entry.path, name + "/", suffixes, out)
        elif entry.name.endswith(suffixes):
            out.append(_line(entry.path, name))


@functools.cache
def _inits(suffixes: tuple[str, ...]) -> frozenset[str]:
    return frozenset("__init__" + s for s in suffixes)


def _line(path: str, name: str) -> str:
    st = os.stat(path)
    return f"{name}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"


def fingerprint(root: str | os.PathLike[str], *, version: str = "", commit: str = "") -> str:
    """A digest of the identity of every file ``torch_key`` reads under ``root`` (see the module docstring)."""
    lines = [f"format\0{_FORMAT}", f"root\0{os.path.abspath(root)}", f"version\0{version}", f"commit\0{commit}"]
    lines.append(f"python\0{sys.implementation.cache_tag}")
    files: list[str] = []
    _walk(os.fspath(root), "", _module_suffixes(), files)
    lines.extend(files)
    for extra in _EXTRA:
        path = os.path.join(root, extra)
        lines.append(_line(path, extra) if os.path.exists(path) else f"{extra}\0absent")
    return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogateescape")).hexdigest()


def _trusted(st: os.stat_result, *, directory: bool) -> bool:
    """The store's one trust rule, with its one trusted set (this user, root, ``ADSTORE_TRUSTED_UIDS``)."""
    try:
        trusted = trusted_uids()
    except ConfigError:
        return False
    return (dir_refusal if directory else file_refusal)(st, trusted) is None


def _read(path: Path, digest: str) -> bytes | None:
    """The recorded key for ``digest`` from a trusted, well-formed record; None otherwise (logged at debug)."""
    try:
        if not _trusted(os.stat(path.parent), directory=True):
            logger.debug("adstore: %s is in a directory others may write: not read", path)
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.debug("adstore: %s not read: %s", path, exc)
        return None
    with os.fdopen(fd, "rb") as fh:
        if not _trusted(os.fstat(fh.fileno()), directory=False):
            logger.debug("adstore: %s is not a file only this user or root writes: not read", path)
            return None
        data = fh.read(4096)
    try:
        doc = json.loads(data)
        if doc.get("format") != _FORMAT or doc.get("fingerprint") != digest:
            return None
        key = bytes.fromhex(doc["torch_key"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return key if len(key) == hashlib.sha256().digest_size else None


def _write(path: Path, digest: str, key: bytes) -> None:
    doc = {"format": _FORMAT, "fingerprint": digest, "torch_key": key.hex()}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _computation(torch_key: Any) -> Callable[[], Any] | None:
    """torch's own computation behind ``torch_key``'s process cache (``prefetchable_cache``'s ``func``); None if hidden.

    Called, it hashes the files as they are now, whatever this process
    cached: the only value a record may bind to a fingerprint taken now.
    """
    try:
        func = inspect.getclosurevars(torch_key).nonlocals.get("func")
    except (TypeError, ValueError):
        return None
    return func if callable(func) else None


def _record(torch_key: Any, compute: Callable[[], Any], path: Path, sign: Callable[[], str], before: str) -> None:
    """Compute the key of the files ``before`` describes and record it, if they still are those files.

    ``before`` is taken before ``compute`` runs and ``sign()`` again after: a
    change in between (a file edited while it was hashed, or before) is no
    record, and torch computes its key itself.
    """
    try:
        key = compute()
        if not isinstance(key, bytes):
            return
        if sign() != before:
            logger.debug("adstore: torch's files changed while torch_key was computed: not recorded in %s", path)
            return
        _write(path, before, key)
        try:
            torch_key.set(key)  # spares torch the same hashing, unless it has its value already
        except RuntimeError:
            pass
    except Exception as exc:  # noqa: BLE001 - a record is an optimisation: the next process computes again
        logger.debug("adstore: torch_key not recorded in %s: %s", path, exc)


#: This process's recording thread (the latest ``prime``'s), for :func:`wait_recorded`.
_recording: list[threading.Thread] = []
#: How long :func:`wait_recorded` waits at most (the hashing takes about 0.6 s).
RECORD_WAIT = 10.0


def wait_recorded(timeout: float = RECORD_WAIT) -> None:
    """Let a recording thread of this process finish before ``torch_key()`` is asked for (``timeout`` at most).

    The thread hashes torch's files itself (not through torch's cache) and
    then gives torch the value: asked for meanwhile, torch would hash the
    same files a second time.  Never raises.
    """
    for thread in list(_recording):
        if thread is not threading.current_thread():
            thread.join(timeout)


def prime(directory: str | os.PathLike[str] | None = None) -> Primed:
    """Give ``torch_key`` its recorded value if torch's files are as recorded, else record it once known.

    ``directory``: where the record lives (default: Inductor's cache
    directory, ``TORCHINDUCTOR_CACHE_DIR`` or its default).  Never raises.
    """
    try:
        import torch
        from torch._inductor import codecache

        torch_key = codecache.torch_key
        if not callable(getattr(torch_key, "set", None)):
            return Primed("unsupported", "this torch's torch_key cannot be prepopulated")
        if directory is None:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            directory = cache_dir()
        path = Path(directory) / RECORD
        root = getattr(codecache, "_TORCH_PATH", None) or os.path.dirname(torch.__file__)
        commit = str(getattr(torch.version, "git_version", ""))
        sign = functools.partial(fingerprint, root, version=torch.__version__, commit=commit)
        digest = sign()  # before any key is computed for it (``_record``)
        key = _read(path, digest)
        if key is not None:
            try:
                torch_key.set(key)
            except RuntimeError:  # computed already in this process: nothing left to save
                return Primed("known", "torch_key was computed before")
            return Primed("primed", str(path))
        compute = _computation(torch_key)
        if compute is None:
            return Primed("unsupported", "this torch's torch_key computation is not reachable: nothing recorded")
        args = (torch_key, compute, path, sign, digest)
        thread = threading.Thread(target=_record, args=args, name="adstore-torch-key", daemon=True)
        thread.start()
        _recording[:] = [thread]
        return Primed("recording", str(path), thread)
    except Exception as exc:  # noqa: BLE001 - fail open: torch computes its key as it would have
        logger.debug("adstore: torch_key not primed: %s: %s", type(exc).__name__, exc)
        return Primed("error", f"{type(exc).__name__}: {exc}")
