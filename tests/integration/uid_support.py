"""Run a function as another real user, in a store shared through a setgid group directory.

The tests run as root.  A forked child drops to ``uid`` (groups: the shared
group, umask ``002``, as docs/configuration.md, "A store shared by several
users" sets a group up) and sends back what the function returned, as JSON.
The interpreter and everything it imported come with the fork.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["ALICE", "BOB", "GROUP", "as_uid", "shared_root"]

ALICE, BOB = 1001, 1002
GROUP = 4711  # both are members; the store's directory belongs to it


@contextmanager
def shared_root() -> Iterator[Path]:
    """A group-shared store root (``2775``, group :data:`GROUP`) under a directory every user can reach."""
    base = Path(f"/tmp/adstore-seal-{uuid.uuid4().hex[:8]}")
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    root = base / "store"
    root.mkdir()
    os.chown(root, 0, GROUP)
    os.chmod(root, 0o2775)
    try:
        yield root
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _preload() -> None:
    """Import what the child imports lazily, while this process can still read it.

    The interpreter may live where the other user cannot look (a ``0700``
    home such as ``/root/.pyenv``): an import after ``setuid`` would fail
    there, which is the machine's layout, not the store's behaviour.
    """
    import importlib

    for name in ("lmdb._envid",):
        try:
            importlib.import_module(name)
        except ImportError:  # another lmdb release: nothing to preload
            pass


def as_uid(uid: int, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> Any:
    """``fn(*args)`` in a forked child running as ``uid`` (group :data:`GROUP`, umask 002); its result.

    Raises ``AssertionError`` with the child's error when it raised.  The
    child's adstore warnings come back as ``{"value": ..., "warnings": [...]}``
    when ``fn`` returns a dict (under the key ``warnings``).
    """
    _preload()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        said: list[str] = []
        try:
            os.setgroups([GROUP])
            os.setgid(GROUP)
            os.setuid(uid)
            os.umask(0o002)
            os.environ.pop("ADSTORE_TRUSTED_UIDS", None)
            os.environ.update(env or {})

            class Grab(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    said.append(record.getMessage())

            logging.getLogger("adstore").addHandler(Grab(level=logging.WARNING))
            out = {"ok": True, "value": fn(*args), "warnings": said}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "warnings": said}
        os.write(w, json.dumps(out, default=str).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks).decode() or '{"ok": false, "error": "no result"}')
    assert out["ok"], f"as uid {uid}: {out['error']} (warnings: {out['warnings']})"
    value = out["value"]
    if isinstance(value, dict):
        value["warnings"] = out["warnings"]
    return value
