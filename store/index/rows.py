"""Typed records of the index and their byte encodings.

Blob rows are fixed-size structs (they are read on every lookup); entries,
manifests and leases are compact JSON so `adstore inspect` and humans can read
them.  Every decoder raises :class:`CorruptRow` on bad bytes, so a damaged
index becomes a miss with reason ``corrupt_index``, never a crash.
"""

from __future__ import annotations

import builtins
import json
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from xxhash import xxh3_64_intdigest

from ..errors import CorruptRow, InvalidKey
from ..names import is_digest, validate_digest, validate_size

__all__ = [
    "BlobRef",
    "BlobRow",
    "Entry",
    "Manifest",
    "LeaseRow",
    "validate_json",
    "MAX_JSON_DEPTH",
    "manifest_key",
    "manifest_prefix",
    "split_manifest_key",
    "manifest_refs",
    "ManifestRefs",
    "manifest_producer",
    "BLOB_ROW",
    "pack_inline",
    "unpack_inline",
    "MANIFEST_SUFFIX",
    "ACCESS_ROW",
    "encode_json",
    "decode_json",
    "FLAG_INLINE",
    "FLAG_QUARANTINED",
    "FLAG_ZSTD",
]

FLAG_INLINE = 1
FLAG_QUARANTINED = 2
FLAG_ZSTD = 4  # the blob's file holds its bytes zstd-compressed (frames and a seek table, ``codec``)


#: How deep key components and manifest metadata may nest: far beyond any real
#: configuration, far below the interpreter's recursion limit (encoders, ``adstore inspect``).
MAX_JSON_DEPTH = 64
_JSON_ATOMS = (str, int, float, bool, type(None))


def validate_json(value: object, what: str) -> object:
    """Return ``value`` if it is JSON data (dicts, lists, atoms) at most :data:`MAX_JSON_DEPTH` deep.

    Checked without recursion before anything is encoded, so a nesting bomb
    or a non-JSON value is an :class:`InvalidKey` naming the field instead of
    a ``RecursionError`` or ``TypeError`` from the encoder, and whatever is
    stored can be decoded and shown again.
    """
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, _JSON_ATOMS):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise InvalidKey(what, f"nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(item, dict):
            if not all(isinstance(k, _JSON_ATOMS) for k in item):
                raise InvalidKey(what, "a mapping key is not a string or number")
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        else:
            raise InvalidKey(what, f"holds a {type(item).__name__}, which is not JSON data")
    return value


@dataclass(frozen=True, slots=True)
class BlobRef:
    """A blob's identity: SHA-256 hex digest of the content plus its size."""

    digest: str
    size: int

    def __post_init__(self) -> None:
        validate_digest(self.digest)
        validate_size(self.size)

    def to_json(self) -> list[Any]:
        return [self.digest, self.size]

    @classmethod
    def trusted(cls, digest: str, size: int) -> BlobRef:
        """Build from an index row without re-validating (hot path of lookup).

        Safe because every path join validates the digest again
        (``Layout.blob_path``), so a damaged row cannot escape the store.
        """
        ref = object.__new__(cls)
        object.__setattr__(ref, "digest", digest)
        object.__setattr__(ref, "size", size)
        return ref


#: A blob row: size (of its content), refcount, last put, flags, stored size (of its file or inline value).
BLOB_ROW = struct.Struct("<QqdBQ")
#: The head of an inline blob's value in ``blobdata``: the checksum of the bytes after it.
_INLINE_HEAD = struct.Struct("<Q")


def pack_inline(data: bytes | memoryview) -> bytes:
    """The ``blobdata`` value of an inline blob: an xxh3-64 checksum, then the bytes.

    A small-blob read must cost a few microseconds: SHA-256 of 4 KiB takes
    about 4 µs here, CRC-32 2 µs, xxh3 0.2 µs.  The checksum only has to
    catch damage to the index's pages (LMDB keeps no checksums of its own);
    the SHA-256 digest stays the blob's identity and ``verify`` rehashes with
    it.  Kept beside the bytes, so a read needs one get and no blob row.
    """
    return _INLINE_HEAD.pack(xxh3_64_intdigest(data)) + bytes(data)


def unpack_inline(value: bytes) -> tuple[bytes, bool]:
    """The content of a ``blobdata`` value and whether its checksum holds."""
    if len(value) < _INLINE_HEAD.size:
        return value, False
    data = value[_INLINE_HEAD.size :]
    return data, xxh3_64_intdigest(data) == _INLINE_HEAD.unpack_from(value)[0]


@dataclass(slots=True)
class BlobRow:
    """Index row of one blob: size, manifests referencing it, last put, flags, stored size.

    ``size`` is the content's (a :class:`BlobRef`'s); ``stored`` is what the
    blob takes on disk, its file's size (compressed when ``FLAG_ZSTD``,
    ``codec``), or its content's size when inline: budgets count
    ``stored``.  An inline blob's bytes live in ``blobdata`` (see
    :func:`pack_inline`) exactly while its row is flagged inline and not
    quarantined.
    """

    size: int
    refs: int
    touched: float
    flags: int
    stored: int

    @property
    def inline(self) -> bool:
        return bool(self.flags & FLAG_INLINE)

    @property
    def quarantined(self) -> bool:
        return bool(self.flags & FLAG_QUARANTINED)

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_ZSTD)

    def encode(self) -> bytes:
        return BLOB_ROW.pack(self.size, self.refs, self.touched, self.flags, self.stored)

    @classmethod
    def decode(cls, raw: bytes, key: bytes = b"") -> BlobRow:
        if len(raw) != BLOB_ROW.size:
            raise CorruptRow("blobs", key.hex(), f"row of {len(raw)} bytes, expected {BLOB_ROW.size}")
        return cls(*BLOB_ROW.unpack(raw))


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


# The JSON scanner without json.loads' wrapping (a leading-whitespace match, a
# trailing one and two calls): half the cost on a short row, and scans of 100k
# entry rows (eviction planning) are bounded by it.  Rows are written by
# encode_json, so no whitespace surrounds them.
_SCAN_ONCE: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """The JSON object ``raw`` holds, or None if it holds anything else or nothing decodable."""
    try:
        text = raw.decode()
        obj, end = _SCAN_ONCE(text, 0)
    except (StopIteration, ValueError, UnicodeDecodeError, RecursionError):  # nesting bombs too
        return None
    return obj if end == len(text) and type(obj) is dict else None


def decode_json(raw: bytes, db: str, key: bytes) -> dict[str, Any]:
    obj = _json_object(raw)
    if obj is not None:
        return obj
    try:  # the slow path, for the message
        json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptRow(db, key, f"undecodable JSON ({exc})") from None
    raise CorruptRow(db, key, "expected a JSON object")


#: An entry's row in ``access``: last access (epoch seconds), hits.  Apart
#: from the entry's JSON row because hits are recorded all the time: a
#: fixed-size struct is cheap to rewrite, and the entry row (which lookups
#: decode and memoize by its bytes) stays unchanged.
ACCESS_ROW = struct.Struct("<dq")


#: The tail of a manifest key after the cache key and its NUL: rank, generation.
MANIFEST_SUFFIX = struct.Struct(">IQ")


def manifest_prefix(key: str) -> bytes:
    return key.encode() + b"\x00"


def manifest_key(key: str, rank: int, generation: int) -> bytes:
    """Manifests sort by (cache key, rank, generation); keys never contain NUL."""
    return manifest_prefix(key) + MANIFEST_SUFFIX.pack(rank, generation)


def split_manifest_key(raw: bytes) -> tuple[str, int, int]:
    head, sep, tail = raw.partition(b"\x00")
    if not sep or len(tail) != 12:
        raise CorruptRow("manifests", raw, "malformed manifest key")
    rank, generation = MANIFEST_SUFFIX.unpack(tail)
    return head.decode(), rank, generation


#: What :func:`manifest_refs` reads from a manifest row: digests (each once), committed, created.
#: Tuples of atoms, so that the garbage collector stops tracking them (plans hold 100k).
ManifestRefs = tuple[tuple[str, ...], bool, float]


def manifest_refs(raw: bytes) -> ManifestRefs:
    """(digests referenced, committed, created) of a manifest row, decoding only that.

    For scans over many manifests (eviction, removal).  A row that does not
    decode references nothing that can be read back: it yields no digests
    and counts as committed, and ``verify --fix`` recounts the references.
    Only well-formed digests are returned (invariant 2).
    """
    obj = _json_object(raw)
    try:
        found = tuple(dict.fromkeys(d for d, _ in obj["a"].values()))  # type: ignore[index]
        committed, created = bool(obj.get("c")), float(obj.get("t", 0.0))  # type: ignore[union-attr]
    except (ValueError, KeyError, TypeError, AttributeError):
        return (), True, 0.0
    if all(is_digest(d) for d in found):
        return found, committed, created
    return tuple(d for d in found if is_digest(d)), committed, created


def manifest_producer(raw: bytes) -> dict[str, Any]:
    """The ``producer`` of a manifest row (host, pid, start time), decoding only that; {} when unreadable."""
    obj = _json_object(raw)
    found = obj.get("p") if isinstance(obj, dict) else None
    return dict(found) if isinstance(found, dict) else {}


@dataclass(slots=True)
class Manifest:
    """One rank's artifacts of one generation of a cache key."""

    key: str
    rank: int
    world_size: int
    generation: int
    artifacts: dict[str, BlobRef]
    committed: bool = False
    namespace: str = "default"
    producer: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(ref.size for ref in self.artifacts.values())

    def digests(self) -> set[str]:
        return {ref.digest for ref in self.artifacts.values()}

    def encode(self) -> builtins.bytes:
        return encode_json(
            {
                "ws": self.world_size,
                "a": {name: ref.to_json() for name, ref in self.artifacts.items()},
                "c": self.committed,
                "ns": self.namespace,
                "p": self.producer,
                "t": self.created,
                "m": self.meta,
            }
        )

    @classmethod
    def decode(cls, raw_key: builtins.bytes, raw: builtins.bytes) -> Manifest:
        key, rank, generation = split_manifest_key(raw_key)
        obj = decode_json(raw, "manifests", raw_key)
        try:
            artifacts = {}
            for name, (d, s) in obj["a"].items():
                if not is_digest(d) or type(s) is not int or s < 0:
                    raise ValueError(f"artifact {name!r} has a malformed digest or size")
                artifacts[name] = BlobRef.trusted(d, s)
            if int(obj["ws"]) < 1:
                raise ValueError("world size below 1")
            return cls(
                key=key,
                rank=rank,
                world_size=int(obj["ws"]),
                generation=generation,
                artifacts=artifacts,
                committed=bool(obj["c"]),
                namespace=str(obj.get("ns", "default")),
                producer=dict(obj.get("p", {})),
                created=float(obj.get("t", 0.0)),
                meta=dict(obj.get("m", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptRow("manifests", raw_key, f"bad manifest fields ({exc})") from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["artifacts"] = {n: {"digest": r.digest, "size": r.size} for n, r in self.artifacts.items()}
        return d


@dataclass(slots=True)
class Entry:
    """One cache key: the unit of lookup, LRU and eviction (all ranks at once).

    ``components`` (the key's named parts, for `adstore explain`) are stored in
    their own database so that lookups and LRU scans never decode them; they
    are filled in by ``Store.entry``.  ``last_access`` and ``hits`` live in
    the ``access`` database (see :data:`ACCESS_ROW`), so that recording hits
    never rewrites this row; readers fill them in (``manifests.get_entry``).
    """

    key: str
    namespace: str
    world_size: int
    components: dict[str, Any]
    created: float
    last_access: float
    hits: int = 0
    bytes: int = 0
    ranks: dict[int, int] = field(default_factory=dict)
    pinned: bool = False

    def encode(self) -> builtins.bytes:
        return encode_json(
            {
                "ns": self.namespace,
                "ws": self.world_size,
                "t": self.created,
                "b": self.bytes,
                "r": {str(r): g for r, g in self.ranks.items()},
                "pin": self.pinned,
            }
        )

    @classmethod
    def decode(cls, raw_key: builtins.bytes, raw: builtins.bytes) -> Entry:
        obj = decode_json(raw, "entries", raw_key)
        try:
            world_size, created = int(obj["ws"]), float(obj["t"])
            if world_size < 1:
                raise ValueError("world size below 1")
            # Positional, in field order: eviction planning decodes every entry.
            return cls(
                raw_key.decode(),
                str(obj["ns"]),
                world_size,
                {},
                created,
                created,  # last access, until the access row is read
                0,
                int(obj.get("b", 0)),
                {int(r): int(g) for r, g in obj.get("r", {}).items()},
                bool(obj.get("pin", False)),
            )
        except (KeyError, TypeError, ValueError, UnicodeDecodeError, AttributeError) as exc:
            raise CorruptRow("entries", raw_key, f"bad entry fields ({exc})") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class LeaseRow:
    """A pin held by one process: gc skips the key while the holder lives."""

    key: str
    pid: int
    start_time: float
    host: str
    created: float
    expires: float

    def encode(self) -> bytes:
        return encode_json(asdict(self))

    @classmethod
    def decode(cls, raw_key: bytes, raw: bytes) -> LeaseRow:
        obj = decode_json(raw, "leases", raw_key)
        try:
            return cls(**{f: obj[f] for f in ("key", "pid", "start_time", "host", "created", "expires")})
        except (KeyError, TypeError, AttributeError) as exc:
            raise CorruptRow("leases", raw_key, f"bad lease fields ({exc})") from None
