"""Lookup: is a key restorable right now, and if not, why (invariants 5 and 6).

The hot path of every model start: two B-tree reads (entry, manifest) plus
one per blob, with decoded rows reused while their bytes are unchanged.  A
miss always names its :class:`~adstore.store.reasons.Reason`, never raises
(docs/architecture.md, "How an entry lives").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import AmbiguousKey, CorruptRow, KeyNotFound
from .index.rows import BLOB_ROW, FLAG_INLINE, FLAG_QUARANTINED, MANIFEST_SUFFIX, Entry, Manifest
from .index.tables import Tables, Txn
from .names import validate_key
from .reasons import Reason

__all__ = ["LookupResult", "LookupMemo", "lookup", "resolve_key"]

#: ``file_ok(digest, size)``: is the blob file of that digest on disk with that size?
FileCheck = Callable[[str, int], bool]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A hit with its manifest(s), or a miss with a named reason."""

    hit: bool
    reason: Reason | None = None
    manifest: Manifest | None = None
    manifests: dict[int, Manifest] = field(default_factory=dict)
    generation: int | None = None
    entry: Entry | None = None

    def __bool__(self) -> bool:
        return self.hit


# Decoded rows, keyed by their LMDB key and checked against their exact bytes:
# a repeated lookup of an unchanged row decodes no JSON.  A plain dict, not
# functools.lru_cache: on thousands of keys looked up at random, the LRU's
# linked-list bookkeeping costs more than the lookup's LMDB reads.  Cleared
# when full; dict operations are atomic under the GIL.
_DECODED_MAX = 1 << 14
_entries_decoded: dict[bytes, tuple[bytes, Entry]] = {}
_manifests_decoded: dict[bytes, tuple[bytes, Manifest, tuple[tuple[bytes, int, str], ...]]] = {}


def _decode_entry(raw_key: bytes, raw: bytes) -> Entry:
    hit = _entries_decoded.get(raw_key)
    if hit is not None and hit[0] == raw:
        return hit[1]
    entry = Entry.decode(raw_key, raw)
    if len(_entries_decoded) >= _DECODED_MAX:
        _entries_decoded.clear()
    _entries_decoded[raw_key] = (raw, entry)
    return entry


def _decode_manifest(raw_key: bytes, raw: bytes) -> tuple[Manifest, tuple[tuple[bytes, int, str], ...]]:
    """The manifest and its blob checks: (row key, size, digest) per artifact."""
    hit = _manifests_decoded.get(raw_key)
    if hit is not None and hit[0] == raw:
        return hit[1], hit[2]
    m = Manifest.decode(raw_key, raw)
    checks = tuple((bytes.fromhex(ref.digest), ref.size, ref.digest) for ref in m.artifacts.values())
    if len(_manifests_decoded) >= _DECODED_MAX:
        _manifests_decoded.clear()
    _manifests_decoded[raw_key] = (raw, m, checks)
    return m, checks


def _check_blobs(
    t: Txn, checks: tuple[tuple[bytes, int, str], ...], file_ok: FileCheck, files: list[tuple[str, int]]
) -> Reason | None:
    """Invariant 5 for one manifest: every blob registered, not quarantined, of its size.

    Rows are unpacked in place (no BlobRow per check); a file blob's stored
    size (its file's, compressed or not) is checked on disk by ``file_ok``
    (and the blob added to ``files``), an inline blob lives in the index itself.
    """
    for row_key, size, digest in checks:
        raw = t.blob_row_raw(row_key)
        if raw is None:
            return Reason.BLOB_MISSING
        if len(raw) != BLOB_ROW.size:
            raise CorruptRow("blobs", digest, f"row of {len(raw)} bytes, expected {BLOB_ROW.size}")
        row_size, _refs, _touched, flags, stored = BLOB_ROW.unpack(raw)
        if flags & FLAG_QUARANTINED or row_size != size:
            return Reason.BLOB_MISSING
        if not flags & FLAG_INLINE:
            if not file_ok(digest, stored):
                return Reason.BLOB_MISSING
            files.append((digest, stored))
    return None


@dataclass(frozen=True, slots=True)
class _Checked:
    """A hit as checked: the rows it was read from, and its file blobs."""

    entry_raw: bytes
    epoch: bytes | None
    manifests: tuple[tuple[bytes, bytes], ...]  # (manifest key, row bytes) per rank
    files: tuple[tuple[str, int], ...]  # (digest, stored size) of blobs stored as files
    result: LookupResult


class LookupMemo:
    """The hits one store already checked in this process, reused while provably unchanged.

    A repeated lookup re-reads the entry row, each rank's manifest row and the
    blob epoch (``tables.BLOB_EPOCH``) and compares their bytes with the ones
    the hit was checked against.  The blob rows are not read again: every
    transaction that could fail their check (a row dropped, quarantined or
    replaced) moves the epoch (``tables.Txn``).  Files are stat'ed every
    time, since they can vanish without the index knowing.  Damage done to
    the index from outside the store cannot move the epoch; the verified read
    that follows a hit catches it and clears the memo (``Store.get_bytes``).
    Only hits are memoized; a miss is always checked in full.  Bounded;
    cleared when full.
    """

    __slots__ = ("_checked", "_capacity")

    def __init__(self, capacity: int = 1 << 14) -> None:
        self._checked: dict[tuple[str, int | None], _Checked] = {}
        self._capacity = capacity

    def get(self, t: Txn, key: str, rank: int | None, entry_raw: bytes, file_ok: FileCheck) -> LookupResult | None:
        c = self._checked.get((key, rank))
        if c is None or c.entry_raw != entry_raw or t.epoch() != c.epoch:
            return None
        for mk, mraw in c.manifests:
            if t.manifest_row(mk) != mraw:
                return None
        for digest, size in c.files:
            if not file_ok(digest, size):
                return None
        return c.result

    def clear(self) -> None:
        """Trust nothing checked so far (a read found damage the epoch cannot show)."""
        self._checked.clear()

    def put(self, key: str, rank: int | None, checked: _Checked) -> None:
        if len(self._checked) >= self._capacity:
            self._checked.clear()
        self._checked[(key, rank)] = checked


def lookup(t: Txn, key: str, rank: int | None, file_ok: FileCheck, memo: LookupMemo | None = None) -> LookupResult:
    """Check invariants 5-6 for one rank (``rank``) or the whole entry (``None``).

    The returned result, entry and manifests are shared (memoized) and must
    be treated as read-only.
    """
    raw_key = key.encode()
    raw = t.entry_row(raw_key)
    if raw is None:
        return LookupResult(False, Reason.ABSENT)
    if memo is not None:
        known = memo.get(t, key, rank, raw, file_ok)
        if known is not None:
            return known
    entry = _decode_entry(raw_key, raw)
    ranks = (rank,) if rank is not None else range(entry.world_size)
    prefix = raw_key + b"\x00"
    found: dict[int, Manifest] = {}
    rows: list[tuple[bytes, bytes]] = []
    files: list[tuple[str, int]] = []
    for r in ranks:
        gen = entry.ranks.get(r)
        if gen is None:
            pending = any(m.rank == r and not m.committed for m in t.manifests_of(key))
            return LookupResult(False, Reason.UNCOMMITTED if pending else Reason.INCOMPLETE, entry=entry)
        mk = prefix + MANIFEST_SUFFIX.pack(r, gen)
        mraw = t.manifest_row(mk)
        if mraw is None:
            return LookupResult(False, Reason.INCOMPLETE, entry=entry)
        m, checks = _decode_manifest(mk, mraw)
        if m.world_size != entry.world_size:
            return LookupResult(False, Reason.GENERATION_MISMATCH, entry=entry)
        if not m.committed:
            return LookupResult(False, Reason.UNCOMMITTED, entry=entry)
        reason = _check_blobs(t, checks, file_ok, files)
        if reason:
            return LookupResult(False, reason, entry=entry)
        found[r] = m
        rows.append((mk, mraw))
    if len({m.generation for m in found.values()}) > 1:
        return LookupResult(False, Reason.GENERATION_MISMATCH, entry=entry)
    first = found[ranks[0]]
    result = LookupResult(
        True,
        None,
        manifest=first if rank is not None or len(found) == 1 else found.get(0, first),
        manifests=found,
        generation=first.generation,
        entry=entry,
    )
    if memo is not None:
        memo.put(key, rank, _Checked(raw, t.epoch(), tuple(rows), tuple(files), result))
    return result


def resolve_key(tables: Tables, prefix: str) -> str:
    """The one entry key equal to or starting with ``prefix`` (``Store.resolve_key``)."""
    if not isinstance(prefix, str) or not prefix:
        raise KeyNotFound(str(prefix))
    start = validate_key(prefix).encode()  # a prefix of a key is a key: the same rule, the same error
    with tables.read() as t:
        if t.entry_row(start) is not None:
            return prefix
        matches: list[str] = []
        for k, _ in t.entry_rows(start):
            if not k.startswith(start):
                break
            matches.append(k.decode(errors="replace"))
    if not matches:
        raise KeyNotFound(prefix)
    if len(matches) > 1:
        raise AmbiguousKey(prefix, matches)
    return matches[0]
