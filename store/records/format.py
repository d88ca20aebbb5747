"""The one versioned record format: a committed manifest and what its entry needs to be restored.

A record is what invariant 9 keeps beside the index and what the remote
tier ships between hosts (docs/architecture.md, "Records"):
one rank of one generation of a cache key, as a JSON payload::

    {"format": 2, "key": ..., "rank": 0, "world_size": 1, "generation": ...,
     "namespace": "default", "components": {...}, "meta": {...},
     "artifacts": {"name": ["<sha256>", size], ...}, "created": 1.7e9,
     "stored": {"<sha256>": ["zstd", stored size], ...},
     "producer": {...}, "inline": {"<sha256>": "<base64>", ...}}

``producer`` and ``inline`` are optional and only written into the store's
own record files: small blobs live in the index's ``blobdata`` table, which a damaged
index takes with it, so the local record carries their bytes (see
:mod:`.files` for why).  The remote tier leaves it out (its records
list digests; blobs travel through its CAS).  ``stored`` names the blobs
kept as zstd frames (``codec``): in a local record, how their files hold
them; in a remote one, that they travel as frames (``zcas/<sha256>``); a
payload without it is written as format 1, which older readers read.
Readers ignore fields they do not know, and refuse a ``format`` newer than
:data:`RECORD_FORMAT`.

On disk a payload is wrapped with a checksum (:func:`encode_record`): the
SHA-256 of the payload's canonical JSON.  :func:`decode_record` never trusts
a file: every key, name, digest, size and nesting depth is validated before
anything is joined into a path or written into the index, and every failure
is a :class:`BadRecord` with a :class:`~.reasons.Reason` and a sentence,
never an exception from the decoder.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..codec import Encoding
from ..errors import AdstoreError, CorruptRow, InvalidKey
from ..index.rows import BlobRef, Manifest, encode_json, validate_json
from ..names import (
    validate_artifact_name,
    validate_generation,
    validate_key,
    validate_namespace,
    validate_rank,
    validate_size,
    validate_world_size,
)
from ..reasons import Reason

__all__ = [
    "RECORD_FORMAT",
    "RAW_FORMAT",
    "MAX_RECORD_BYTES",
    "BadRecord",
    "Record",
    "payload_of",
    "encode_record",
    "decode_record",
    "parse_payload",
]

#: Version of the record payload; a reader refuses a newer one (``newer_record``, ``remote_unsupported``).
#: 2: ``stored`` names the blobs kept (or shipped) as zstd frames; a payload without any stays 1, so a
#: reader of format 1 still reads it (a remote over the Bazel HTTP protocol ships raw blobs only).
RECORD_FORMAT = 2
#: The format of a payload whose blobs are all stored raw.
RAW_FORMAT = 1

#: Largest record file a reader accepts: artifacts and the inline blobs (each below the inline
#: threshold) of one rank; anything larger is not a record this store wrote.
MAX_RECORD_BYTES = 64 << 20


class BadRecord(CorruptRow):
    """A record that is not restored: why (``reason``) and what was wrong (``detail``)."""

    def __init__(self, where: str, detail: str, reason: Reason = Reason.CORRUPT_RECORD) -> None:
        super().__init__("records", where, detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Record:
    """A validated record: one committed rank of one generation of a key."""

    key: str
    rank: int
    world_size: int
    generation: int
    namespace: str
    components: dict[str, Any]
    artifacts: dict[str, BlobRef]
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    producer: dict[str, Any] = field(default_factory=dict)
    inline: dict[str, bytes] = field(default_factory=dict)  # digest -> bytes, each hashed already
    stored: dict[str, tuple[Encoding, int]] = field(default_factory=dict)  # digest -> (encoding, bytes), not raw

    def manifest(self) -> Manifest:
        """The committed manifest this record restores."""
        return Manifest(
            key=self.key,
            rank=self.rank,
            world_size=self.world_size,
            generation=self.generation,
            artifacts=dict(self.artifacts),
            committed=True,
            namespace=self.namespace,
            producer=dict(self.producer),
            created=self.created,
            meta=dict(self.meta),
        )


def payload_of(
    manifest: Manifest,
    components: Mapping[str, Any],
    *,
    local: bool = False,
    inline: Mapping[str, bytes] | None = None,
    stored: Mapping[str, tuple[Encoding, int]] | None = None,
) -> dict[str, Any]:
    """The record payload of ``manifest`` (with its entry's ``components``).

    ``local``: a record file of this store, which also keeps the producer
    (host, pid, uid) and ``inline`` blobs' bytes by digest; the remote tier
    ships neither.  ``stored``: the blobs kept (a local record) or shipped (a
    remote one) as zstd frames, with their sizes as stored.
    """
    payload: dict[str, Any] = {
        "format": RECORD_FORMAT if stored else RAW_FORMAT,
        "key": manifest.key,
        "rank": manifest.rank,
        "namespace": manifest.namespace,
        "world_size": manifest.world_size,
        "generation": manifest.generation,
        "components": dict(components),
        "artifacts": {name: ref.to_json() for name, ref in sorted(manifest.artifacts.items())},
        "meta": dict(manifest.meta),
        "created": manifest.created,
    }
    if local:
        payload["producer"] = dict(manifest.producer)
    if local and inline:
        payload["inline"] = {d: base64.b64encode(data).decode("ascii") for d, data in sorted(inline.items())}
    if stored:
        payload["stored"] = {d: [str(enc), n] for d, (enc, n) in sorted(stored.items())}
    return payload


def encode_record(payload: Mapping[str, Any]) -> bytes:
    """The bytes of a record file: the payload and the SHA-256 of its canonical JSON."""
    body = encode_json(dict(payload))
    # What encode_json makes of {"record": payload, "sha256": ...} (sorted keys, no spaces), without encoding twice.
    return b'{"record":' + body + b',"sha256":"' + hashlib.sha256(body).hexdigest().encode() + b'"}\n'


def decode_record(raw: bytes, where: str) -> Record:
    """The validated record in a record file's bytes; :class:`BadRecord` for anything else."""
    if len(raw) > MAX_RECORD_BYTES:
        raise BadRecord(where, f"{len(raw)} bytes, more than any record ({MAX_RECORD_BYTES})")
    try:
        outer = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRecord(where, f"not a record file ({type(exc).__name__})") from None
    if (
        not isinstance(outer, dict)
        or not isinstance(outer.get("record"), dict)
        or not isinstance(outer.get("sha256"), str)
    ):
        raise BadRecord(where, "not a record file (no record and checksum)")
    payload = outer["record"]
    try:
        body = encode_json(payload)
    except (ValueError, TypeError, RecursionError):
        raise BadRecord(where, "the record does not encode again") from None
    if hashlib.sha256(body).hexdigest() != outer["sha256"]:
        raise BadRecord(where, "checksum mismatch (the record was changed or damaged)")
    return parse_payload(payload, where)


def parse_payload(payload: Mapping[str, Any], where: str) -> Record:
    """Validate a payload's fields (format, key, names, digests, sizes, nesting, inline bytes)."""
    fmt = payload.get("format")
    if type(fmt) is not int or fmt < 1:
        raise BadRecord(where, f"no record format version ({fmt!r})")
    if fmt > RECORD_FORMAT:
        raise BadRecord(
            where, f"record format {fmt} is newer than this adstore reads ({RECORD_FORMAT})", Reason.NEWER_RECORD
        )
    try:
        key = validate_key(payload.get("key"))
        namespace = validate_namespace(payload.get("namespace"))
        world_size = validate_world_size(payload.get("world_size"))
        rank = validate_rank(payload.get("rank"), world_size)
        generation = validate_generation(payload.get("generation"))
        components, meta, producer = (payload.get(f, {}) for f in ("components", "meta", "producer"))
        for name, value in (("components", components), ("meta", meta), ("producer", producer)):
            if not isinstance(value, dict):
                raise ValueError(f"{name} is not a mapping")
            validate_json(value, name)
        created = payload.get("created", 0.0)
        if type(created) not in (int, float) or not 0 <= created < 1e11:
            raise ValueError(f"created {created!r} is not a time")
        artifacts_raw = payload.get("artifacts")
        if not isinstance(artifacts_raw, dict):  # empty is fine: an entry whose content is its meta
            raise ValueError("no artifacts map")
        artifacts: dict[str, BlobRef] = {}
        for name, ref in artifacts_raw.items():
            if not isinstance(ref, list) or len(ref) != 2:
                raise ValueError(f"artifact {name!r} is not [digest, size]")
            artifacts[validate_artifact_name(name)] = BlobRef(ref[0], validate_size(ref[1]))
        inline = _inline(payload.get("inline", {}), {r.digest: r.size for r in artifacts.values()})
        stored = _stored(payload.get("stored", {}), {r.digest for r in artifacts.values()})
    except (AdstoreError, ValueError, TypeError) as exc:
        detail = exc.why if isinstance(exc, InvalidKey) else str(exc)
        raise BadRecord(where, f"invalid field: {detail[:200]}") from None
    return Record(
        key,
        rank,
        world_size,
        generation,
        namespace,
        components,
        artifacts,
        meta,
        float(created),
        producer,
        inline,
        stored,
    )


def _stored(raw: object, digests: set[str]) -> dict[str, tuple[Encoding, int]]:
    """How the blobs of a payload that are not raw are stored: each an artifact's, a known encoding, a size."""
    if not isinstance(raw, dict):
        raise ValueError("stored is not a mapping")
    out: dict[str, tuple[Encoding, int]] = {}
    for digest, how in raw.items():
        if digest not in digests or not isinstance(how, list) or len(how) != 2 or how[0] != Encoding.ZSTD:
            raise ValueError(f'stored blob {str(digest)[:80]!r} is no artifact of the record, or not ["zstd", size]')
        out[digest] = (Encoding.ZSTD, validate_size(how[1]))
    return out


def _inline(raw: object, sizes: Mapping[str, int]) -> dict[str, bytes]:
    """The inline blobs of a payload, each one an artifact's and hashing to its digest."""
    if not isinstance(raw, dict):
        raise ValueError("inline is not a mapping")
    out: dict[str, bytes] = {}
    for digest, text in raw.items():
        if digest not in sizes or not isinstance(text, str):
            raise ValueError(f"inline blob {str(digest)[:80]!r} is no artifact of the record")
        try:
            data = base64.b64decode(text.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise ValueError(f"inline blob {digest} is not base64") from None
        if len(data) != sizes[digest] or hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"inline blob {digest} does not hash to its digest")
        out[digest] = data
    return out
