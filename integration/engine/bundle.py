"""A directory tree as one verified blob: what Inductor wrote while compiling, carried with a stage's entry.

The ``torch_compile`` compile stage stores the files Inductor wrote under
its cache directory (compiled kernels, FX-graph and AOTAutograd cache
entries) as one blob, and a restart unpacks them into a fresh directory
before compiling there (docs/engine-cache.md, "Trust").  Those files are code
(shared objects, Python modules, pickles), so :func:`unpack` trusts nothing
in the blob: every check runs before the first byte is written.

Layout: a fixed header (magic, header length, payload length, SHA-256 of
header + payload), a JSON header ``{"format": 1, "files": [[path, size,
sha256], ...]}``, then the files' bytes in that order.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from adstore.integration.engine.record import frame, unframe
from adstore.integration.errors import CorruptEngine
from adstore.integration.placement.capture import read_files
from adstore.integration.placement.rule import trusted_uids
from adstore.store import is_digest

__all__ = ["BUNDLE_VERSION", "MAX_FILES", "pack", "unpack"]

BUNDLE_VERSION = 1
#: More files than any compile writes; a header claiming more is refused before anything is written.
MAX_FILES = 100_000
_MAGIC = b"ADSTREE1"
_PART = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,254}")
_MAX_DEPTH = 16


def pack(root: Path) -> bytes:
    """Every regular file under ``root`` (symlinks and other kinds are left out), sorted by path.

    Read under the rule for files that become code (``placement.capture.read_files``):
    a file no trusted user owns, or in a directory another user could rename in, is refused.
    """
    paths: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            _check_path(rel)
            paths.append((rel, str(path)))
    read = read_files([p for _, p in paths], trusted_uids())
    files = [(rel, read[p]) for rel, p in paths]
    header = json.dumps(
        {
            "format": BUNDLE_VERSION,
            "files": [[rel, len(data), hashlib.sha256(data).hexdigest()] for rel, data in files],
        },
        separators=(",", ":"),
    ).encode()
    return frame(_MAGIC, header, b"".join(data for _, data in files))


def unpack(blob: bytes, dest: Path) -> int:
    """Write the files of ``blob`` under ``dest`` (a directory this process made, empty); returns their count.

    CorruptEngine / TruncatedEngine for a blob that is not exactly a bundle
    (checksum, layout, a path that is absolute, climbs out, or uses other
    characters, sizes or digests that do not add up); nothing is written then.
    """
    head, body = unframe(blob, _MAGIC, "Inductor bundle")
    try:
        header = json.loads(bytes(head))
    except ValueError as exc:
        raise CorruptEngine(f"Inductor bundle header is not JSON: {exc}") from exc
    files = _check_header(header, len(body))
    offset = 0
    plan: list[tuple[str, memoryview]] = []
    for rel, size, sha in files:
        data = body[offset : offset + size]
        offset += size
        if hashlib.sha256(data).hexdigest() != sha:
            raise CorruptEngine(f"Inductor bundle file {rel} does not match its digest")
        plan.append((rel, data))
    for rel, data in plan:
        _write(dest, rel, data)
    return len(plan)


def _check_header(header: object, payload_len: int) -> list[tuple[str, int, str]]:
    if (
        not isinstance(header, dict)
        or header.get("format") != BUNDLE_VERSION
        or not isinstance(header.get("files"), list)
    ):
        raise CorruptEngine("Inductor bundle header has another format")
    entries = header["files"]
    if len(entries) > MAX_FILES:
        raise CorruptEngine(f"Inductor bundle lists {len(entries)} files (at most {MAX_FILES})")
    out: list[tuple[str, int, str]] = []
    seen: set[str] = set()
    total = 0
    for item in entries:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[0], str)
            and type(item[1]) is int
            and isinstance(item[2], str)
            and item[1] >= 0
            and is_digest(item[2])
        ):
            raise CorruptEngine(f"Inductor bundle has a malformed file entry: {str(item)[:80]}")
        _check_path(item[0])
        if item[0] in seen:
            raise CorruptEngine(f"Inductor bundle lists {item[0]} twice")
        seen.add(item[0])
        total += item[1]
        out.append((item[0], item[1], item[2]))
    if total != payload_len:
        raise CorruptEngine(f"Inductor bundle files add up to {total} bytes, its payload is {payload_len}")
    prefixes = {"/".join(p.split("/")[:i]) for p in seen for i in range(1, p.count("/") + 1)}
    if prefixes & seen:
        raise CorruptEngine("Inductor bundle lists a file that is also a directory")
    return out


def _check_path(rel: str) -> None:
    parts = rel.split("/")
    if len(parts) > _MAX_DEPTH or not all(_PART.fullmatch(p) and p not in (".", "..") for p in parts):
        raise CorruptEngine(f"Inductor bundle path {rel[:120]!r} is not a plain relative path")


def _write(dest: Path, rel: str, data: memoryview) -> None:
    """Create ``dest/rel`` exclusively (never following a link, never replacing a file)."""
    target = dest
    for part in rel.split("/")[:-1]:
        target = target / part
        try:
            os.mkdir(target, 0o700)
        except FileExistsError:
            if target.is_symlink() or not target.is_dir():
                raise CorruptEngine(f"Inductor bundle directory {part!r} is not a directory here") from None
    fd = os.open(target / rel.rsplit("/", 1)[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
