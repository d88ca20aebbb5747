"""The stored form of one compiled engine: a header, JSON metadata and the AOTInductor package.

A record is what every engine storage back end keeps under an engine hash
(docs/engine-cache.md, "The engine cache").  One SHA-256 covers metadata and package; a blob
that is truncated, bit-flipped or written for another hash fails
:meth:`EngineRecord.from_bytes` with a reasoned error, which the engine cache
turns into a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adstore.integration.errors import CorruptEngine, EngineCacheError, EngineMismatch, TruncatedEngine

__all__ = ["ENGINE_FORMAT_VERSION", "EngineRecord", "check_meta", "check_package_file", "frame", "unframe"]

logger = logging.getLogger(__name__)

#: Version of the record layout and of the metadata schema; another version is a miss.
ENGINE_FORMAT_VERSION = 1

_MAGIC = b"ADSENGv1"
_HEADER = struct.Struct(">8sQQ32s")  # magic, first part's length, second part's length, sha256(first + second)


def frame(magic: bytes, first: bytes, second: bytes) -> bytes:
    """Two parts under one header and one SHA-256: the layout of engine records and Inductor bundles."""
    digest = hashlib.sha256(first + second).digest()
    return _HEADER.pack(magic, len(first), len(second), digest) + first + second


def unframe(blob: bytes | memoryview, magic: bytes, what: str) -> tuple[memoryview, memoryview]:
    """The two parts of a :func:`frame`; TruncatedEngine / CorruptEngine (naming ``what``) unless exact."""
    view = memoryview(blob)
    if len(view) < _HEADER.size:
        raise TruncatedEngine(f"{what} of {len(view)} bytes is shorter than its header")
    found, first_len, second_len, digest = _HEADER.unpack_from(view)
    if found != magic:
        raise CorruptEngine(f"{what} has magic {bytes(found)!r}, expected {magic!r}")
    want = _HEADER.size + first_len + second_len
    if len(view) < want:
        raise TruncatedEngine(f"{what} has {len(view)} bytes, its header says {want}")
    if len(view) > want:
        raise CorruptEngine(f"{what} has {len(view) - want} trailing bytes")
    body = view[_HEADER.size :]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptEngine(f"{what} checksum mismatch")
    return body[:first_len], body[first_len:]


def check_meta(meta: Any, expected_hash: str) -> dict[str, Any]:
    if not isinstance(meta, dict):
        raise CorruptEngine("engine metadata is not a JSON object")
    version = meta.get("format_version")
    if version != ENGINE_FORMAT_VERSION:
        raise EngineMismatch("format_version", f"record has {version!r}, this adstore reads {ENGINE_FORMAT_VERSION}")
    if meta.get("hash") != expected_hash:
        raise EngineMismatch("hash", f"record was written for {meta.get('hash')!r}, asked for {expected_hash!r}")
    payload = meta.get("payload")
    if (
        not isinstance(payload, dict)
        or not isinstance(payload.get("sha256"), str)
        or not isinstance(payload.get("size"), int)
    ):
        raise CorruptEngine("engine metadata has no payload checksum")
    return meta


def check_package_file(path: Path, meta: Mapping[str, Any]) -> None:
    """Raise CorruptEngine unless the package file at ``path`` is the one ``meta`` checksums.

    The engine cache calls it before loading a package from its in-process copy:
    the copy sits in a temp directory for the life of the process, and a package
    is native code, so bytes changed behind the cache's back must never be loaded.
    """
    payload = meta.get("payload") or {}
    try:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        size = path.stat().st_size
    except OSError as exc:
        raise CorruptEngine(f"engine package copy {path.name} cannot be read: {exc}") from exc
    if size != payload.get("size") or digest != payload.get("sha256"):
        raise CorruptEngine(
            f"engine package copy {path.name} changed: sha256 {digest[:16]} ({size} bytes), "
            f"the record says {str(payload.get('sha256'))[:16]} ({payload.get('size')} bytes)"
        )


@dataclass
class EngineRecord:
    """One stored engine: metadata plus the package, as bytes or as a file.

    ``payload_path`` with ``owns_path=True`` is a temp copy made for this read;
    :meth:`release` deletes it (the engine cache calls it once the package is loaded
    or copied into its in-process layer).
    """

    hash: str
    meta: dict[str, Any]
    payload: bytes | None = None
    payload_path: Path | None = None
    owns_path: bool = False
    #: Bytes the remote tier downloaded for this read (None: it came from the local store).
    transferred: int | None = None
    #: Who wrote the blob file ``payload_path`` was copied from (``placement.rule.Writer``; None: not from a store).
    writer: Any = None
    _released: bool = field(default=False, repr=False)

    @property
    def payload_size(self) -> int:
        return int(self.meta["payload"]["size"])

    @classmethod
    def create(cls, hash: str, meta: Mapping[str, Any], payload: bytes) -> EngineRecord:
        """A new record; fills in the format version, hash and payload checksum."""
        full = dict(meta)
        full["format_version"] = ENGINE_FORMAT_VERSION
        full["hash"] = hash
        given = full.get("payload")  # extra fields a caller keeps beside the checksum; anything else is replaced
        full["payload"] = {
            **(dict(given) if isinstance(given, Mapping) else {}),
            "sha256": hashlib.sha256(payload).hexdigest(),
            "size": len(payload),
        }
        return cls(hash=hash, meta=full, payload=bytes(payload))

    def meta_bytes(self) -> bytes:
        return json.dumps(self.meta, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def payload_bytes(self) -> bytes:
        if self.payload is not None:
            return self.payload
        if self.payload_path is None:
            raise EngineCacheError(f"engine record {self.hash} has no payload")
        return self.payload_path.read_bytes()

    def to_bytes(self) -> bytes:
        """The backend blob: header, metadata JSON, package."""
        return frame(_MAGIC, self.meta_bytes(), self.payload_bytes())

    @classmethod
    def from_bytes(cls, blob: bytes, *, expected_hash: str) -> EngineRecord:
        """Parse and verify a backend blob; CorruptEngine / TruncatedEngine / EngineMismatch on trouble."""
        head, body = unframe(blob, _MAGIC, "engine blob")
        try:
            meta = json.loads(bytes(head).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptEngine(f"engine metadata is not JSON: {exc}") from exc
        meta = check_meta(meta, expected_hash)
        payload = bytes(body)
        if meta["payload"]["size"] != len(payload) or meta["payload"]["sha256"] != hashlib.sha256(payload).hexdigest():
            raise CorruptEngine("engine payload does not match its metadata")
        return cls(hash=expected_hash, meta=meta, payload=payload)

    def __enter__(self) -> EngineRecord:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Delete the temp copy this record owns (idempotent)."""
        if self.owns_path and self.payload_path is not None and not self._released:
            self._released = True
            try:
                self.payload_path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("could not remove temp engine copy %s: %s", self.payload_path, exc)
