"""What this host puts into its keys, and the keys it missed: what ``adstore explain`` compares across hosts.

A key is a digest: a host that missed cannot be compared with the entry it
should have hit unless its key's components are known.  So a miss of an
Inductor entry notes the key and its components in a small journal of the
user's (:func:`note_miss`, ``$ADSTORE_MISS_LOG`` or
``$XDG_CACHE_HOME/adstore/misses.jsonl``; never in the store, which may be
read-only), and ``adstore explain KEY`` reads it (:func:`missed_components`)
to find the nearest stored entry and name the component that differs.
The host's own components (``adstore explain --host``) are
:func:`adstore.integration.inductor.entries.host_report`: they need the
entries, which note their misses here, so this journal imports nothing of the
integration.

Importing this module does not import torch (the CLI imports it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["MISS_LOG_VAR", "MISS_LOG_BYTES", "miss_log", "missed_components", "note_miss", "recent_misses"]

#: The environment variable naming the miss journal (a file path; empty: no journal).
MISS_LOG_VAR = "ADSTORE_MISS_LOG"
#: The journal's size before it is rotated to ``<name>.1`` (the previous ``.1`` goes).
MISS_LOG_BYTES = 1 << 20


def miss_log(environ: Mapping[str, str] | None = None) -> Path | None:
    """The journal's path: ``$ADSTORE_MISS_LOG``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``; None if off."""
    env = os.environ if environ is None else environ
    if MISS_LOG_VAR in env:
        return Path(env[MISS_LOG_VAR]) if env[MISS_LOG_VAR] else None
    base = env.get("XDG_CACHE_HOME") or (os.path.join(env["HOME"], ".cache") if env.get("HOME") else "")
    return Path(base, "adstore", "misses.jsonl") if base else None


def note_miss(key: str, components: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> None:
    """Append ``key`` and its components to the journal; best effort, never raises."""
    path = miss_log(environ)
    if path is None:
        return
    try:
        line = json.dumps({"key": key, "components": components}, sort_keys=True, default=str) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            if path.stat().st_size + len(line) > MISS_LOG_BYTES:
                os.replace(path, path.with_name(path.name + ".1"))
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, line.encode())  # one write of one line: concurrent writers do not interleave
        finally:
            os.close(fd)
    except (OSError, TypeError, ValueError):
        pass


def _lines(path: Path) -> Iterator[str]:
    for candidate in (path, path.with_name(path.name + ".1")):
        try:
            text = candidate.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        yield from reversed(text.splitlines())


def _records(environ: Mapping[str, str] | None) -> Iterator[dict[str, Any]]:
    """The journal's well-formed records, newest first."""
    path = miss_log(environ)
    if path is None:
        return
    for line in _lines(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("key"), str)
            and isinstance(record.get("components"), dict)
        ):
            yield {"key": record["key"], "components": record["components"]}


def missed_components(key: str, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The components a lookup of ``key`` (a full key, or a prefix of one) recorded when it missed; None if none."""
    return next((r for r in _records(environ) if r["key"].startswith(key)), None)


def recent_misses(limit: int, environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The ``limit`` most recently missed keys (each once) with their components, newest first."""
    out: dict[str, dict[str, Any]] = {}
    for record in _records(environ):
        if len(out) >= limit:
            break
        out.setdefault(record["key"], record)
    return list(out.values())
