"""Manifest and entry operations inside one LMDB transaction.

A save publishes each rank's manifest *uncommitted*, with the blob refcounts
bumped in the same transaction (invariant 3), and commits it only when every
rank saved.  Committing a generation replaces the rank's older generation and
releases its blob references.  Lookup checks invariants 5 and 6 and names the
reason of every miss.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import lmdb

from .errors import BlobMissing, CorruptRecord, StoreError
from .leases import hostname
from .records import (
    ACCESS_ROW,
    BLOB_ROW,
    FLAG_INLINE,
    FLAG_QUARANTINED,
    MANIFEST_SUFFIX,
    BlobRef,
    BlobRow,
    Entry,
    Manifest,
    decode_json,
    encode_json,
    manifest_key,
    manifest_prefix,
)
from .stats import BLOB_EPOCH, LOGICAL, bump

__all__ = [
    "LookupResult",
    "publish_txn",
    "commit_txn",
    "drop_manifest_txn",
    "drop_entry_txn",
    "iter_manifests",
    "manifest_digests",
    "get_entry",
    "with_access",
    "read_access",
    "put_access",
    "get_components",
    "lookup_txn",
    "LookupMemo",
]

Dbs = Mapping[str, Any]
#: ``file_ok(digest, size)``: is the blob file of that digest on disk with that size?
FileCheck = Callable[[str, int], bool]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A hit with its manifest(s), or a miss with a named reason."""

    hit: bool
    reason: str | None = None
    manifest: Manifest | None = None
    manifests: dict[int, Manifest] = field(default_factory=dict)
    generation: int | None = None
    entry: Entry | None = None

    def __bool__(self) -> bool:
        return self.hit


def get_entry(txn: lmdb.Transaction, dbs: Dbs, key: str) -> Entry | None:
    """The entry of ``key`` with its last access and hits, or None."""
    raw_key = key.encode()
    raw = txn.get(raw_key, db=dbs["entries"])
    return None if raw is None else with_access(txn, dbs, Entry.decode(raw_key, raw))


def read_access(txn: lmdb.Transaction, dbs: Dbs, raw_key: bytes) -> tuple[float, int] | None:
    """(last access, hits) of an entry from its ``access`` row; None if absent or unreadable."""
    raw = txn.get(raw_key, None, dbs["access"])
    return ACCESS_ROW.unpack(raw) if raw is not None and len(raw) == ACCESS_ROW.size else None


def with_access(txn: lmdb.Transaction, dbs: Dbs, entry: Entry) -> Entry:
    """Fill in ``entry``'s last access and hits from its ``access`` row (if readable)."""
    access = read_access(txn, dbs, entry.key.encode())
    if access is not None:
        entry.last_access, entry.hits = access
    return entry


def put_access(txn: lmdb.Transaction, dbs: Dbs, key: str, when: float, hits: int) -> None:
    txn.put(key.encode(), ACCESS_ROW.pack(when, hits), db=dbs["access"])


def get_components(txn: lmdb.Transaction, dbs: Dbs, key: str) -> dict[str, Any]:
    raw = txn.get(key.encode(), db=dbs["components"])
    return {} if raw is None else decode_json(raw, "components", key.encode())


def _put_components(txn: lmdb.Transaction, dbs: Dbs, key: str, components: Mapping[str, Any]) -> None:
    if components:
        txn.put(key.encode(), encode_json(dict(components)), db=dbs["components"])


def _manifest_rows(txn: lmdb.Transaction, dbs: Dbs, key: str) -> Iterator[tuple[bytes, bytes]]:
    """(manifest key, row) of every manifest of ``key``: every rank, every generation."""
    prefix = manifest_prefix(key)
    cur = txn.cursor(db=dbs["manifests"])
    if not cur.set_range(prefix):
        return
    for raw_key, raw in cur:
        if not raw_key.startswith(prefix):
            break
        yield bytes(raw_key), bytes(raw)


def iter_manifests(txn: lmdb.Transaction, dbs: Dbs, key: str) -> Iterator[Manifest]:
    for raw_key, raw in _manifest_rows(txn, dbs, key):
        yield Manifest.decode(raw_key, raw)


def manifest_digests(txn: lmdb.Transaction, dbs: Dbs, key: str) -> Iterator[set[str]]:
    """The digests each manifest of ``key`` references, decoding nothing else.

    For scans over many entries (eviction planning); an undecodable row
    yields no digests (see ``_manifest_refs``).
    """
    for _, raw in _manifest_rows(txn, dbs, key):
        yield _manifest_refs(raw)[0]


def _get_manifest(txn: lmdb.Transaction, dbs: Dbs, key: str, rank: int, gen: int) -> Manifest | None:
    mk = manifest_key(key, rank, gen)
    raw = txn.get(mk, db=dbs["manifests"])
    return None if raw is None else Manifest.decode(mk, raw)


def _adjust_refs(txn: lmdb.Transaction, dbs: Dbs, digests: set[str], delta: int) -> list[str]:
    """Add ``delta`` to each blob's refcount; returns digests now at zero."""
    zero: list[str] = []
    for digest in digests:
        k = bytes.fromhex(digest)
        raw = txn.get(k, db=dbs["blobs"])
        if raw is None:
            if delta > 0:
                raise BlobMissing(digest, "not registered")
            continue
        row = BlobRow.decode(raw, k)
        row.refs = max(0, row.refs + delta)
        txn.put(k, row.encode(), db=dbs["blobs"])
        if row.refs == 0:
            zero.append(digest)
    return zero


def publish_txn(
    txn: lmdb.Transaction,
    dbs: Dbs,
    *,
    key: str,
    rank: int,
    world_size: int,
    generation: int,
    artifacts: Mapping[str, BlobRef],
    namespace: str,
    components: Mapping[str, Any],
    meta: Mapping[str, Any],
    file_ok: FileCheck,
) -> Manifest:
    """Record an uncommitted manifest and take references on its blobs."""
    for ref in artifacts.values():
        k = bytes.fromhex(ref.digest)
        raw = txn.get(k, db=dbs["blobs"])
        if raw is None:
            raise BlobMissing(ref.digest, "not registered (put it before publishing)")
        row = BlobRow.decode(raw, k)
        if row.size != ref.size or row.quarantined or not (row.inline or file_ok(ref.digest, ref.size)):
            raise BlobMissing(ref.digest, "absent, quarantined or of the wrong size")
    old = _get_manifest(txn, dbs, key, rank, generation)
    if old is not None:
        if old.committed:
            raise StoreError(f"{key} rank {rank} generation {generation} is already committed")
        _adjust_refs(txn, dbs, old.digests(), -1)
    now = time.time()
    manifest = Manifest(
        key=key,
        rank=rank,
        world_size=world_size,
        generation=generation,
        artifacts=dict(artifacts),
        committed=False,
        namespace=namespace,
        producer={"host": hostname(), "pid": os.getpid(), "uid": os.geteuid()},
        created=now,
        meta=dict(meta),
    )
    _adjust_refs(txn, dbs, manifest.digests(), +1)
    txn.put(manifest_key(key, rank, generation), manifest.encode(), db=dbs["manifests"])
    entry = get_entry(txn, dbs, key)
    if entry is None:
        entry = Entry(key, namespace, world_size, {}, now, now)
        txn.put(key.encode(), entry.encode(), db=dbs["entries"])
        put_access(txn, dbs, key, now, 0)
        _put_components(txn, dbs, key, components)
    return manifest


def commit_txn(txn: lmdb.Transaction, dbs: Dbs, *, key: str, rank: int, generation: int,
               components: Mapping[str, Any] | None = None) -> tuple[Manifest, list[str]]:
    """Mark a manifest committed and make it the rank's current generation.

    Returns the manifest and the digests whose refcount dropped to zero
    because the older generation was released.
    """
    manifest = _get_manifest(txn, dbs, key, rank, generation)
    if manifest is None:
        raise StoreError(f"no manifest to commit for {key} rank {rank} generation {generation}")
    manifest.committed = True
    txn.put(manifest_key(key, rank, generation), manifest.encode(), db=dbs["manifests"])
    now = time.time()
    entry = get_entry(txn, dbs, key) or Entry(key, manifest.namespace, manifest.world_size, {}, now, now)
    zero: list[str] = []
    old_gen = entry.ranks.get(rank)
    if old_gen is not None and old_gen != generation:
        zero += _release_generation(txn, dbs, key, rank, old_gen)
    entry.ranks[rank] = generation
    # A new topology: ranks beyond the new world size belong to an old save.
    for r in [r for r in entry.ranks if r >= manifest.world_size]:
        zero += _release_generation(txn, dbs, key, r, entry.ranks.pop(r))
    entry.world_size = manifest.world_size
    entry.namespace = manifest.namespace
    if components is not None:
        _put_components(txn, dbs, key, components)
    put_access(txn, dbs, key, now, entry.hits)
    new_bytes = 0
    for r, g in entry.ranks.items():
        m = manifest if r == rank else _get_manifest(txn, dbs, key, r, g)
        new_bytes += m.bytes if m is not None else 0
    bump(txn, dbs["meta"], LOGICAL, new_bytes - entry.bytes)
    entry.bytes = new_bytes
    txn.put(key.encode(), entry.encode(), db=dbs["entries"])
    return manifest, zero


def _release_generation(txn: lmdb.Transaction, dbs: Dbs, key: str, rank: int, generation: int) -> list[str]:
    """Drop a superseded manifest; a row that no longer decodes is deleted as is.

    A damaged old row must not block every later save of its key; its blob
    references cannot be read back, so ``verify --fix`` recounts them.
    """
    try:
        old = _get_manifest(txn, dbs, key, rank, generation)
    except CorruptRecord:
        txn.delete(manifest_key(key, rank, generation), db=dbs["manifests"])
        return []
    return drop_manifest_txn(txn, dbs, old) if old is not None else []


def drop_manifest_txn(txn: lmdb.Transaction, dbs: Dbs, manifest: Manifest) -> list[str]:
    """Delete one manifest row and release its blob references."""
    txn.delete(manifest_key(manifest.key, manifest.rank, manifest.generation), db=dbs["manifests"])
    return _adjust_refs(txn, dbs, manifest.digests(), -1)


def _manifest_refs(raw: bytes) -> tuple[set[str], bool, float]:
    """(digests referenced, committed, created) of a manifest row, decoding only that.

    A row that does not decode yields no digests: its references cannot be
    read back, and ``verify --fix`` recounts them.
    """
    try:
        obj = json.loads(raw.decode())
        found = {d for d, _ in obj["a"].values()}
        committed, created = bool(obj.get("c")), float(obj.get("t", 0.0))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError):
        return set(), True, 0.0
    return {d for d in found if isinstance(d, str) and len(d) == 64 and _is_hex(d)}, committed, created


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return text == text.lower()


def drop_entry_txn(
    txn: lmdb.Transaction,
    dbs: Dbs,
    key: str,
    entry: Entry | None = None,
    *,
    keep_pending_since: float | None = None,
) -> list[str]:
    """Delete an entry with all its manifests (every rank, every generation).

    ``entry`` is the already decoded row when the caller has it (eviction
    does), so the hot path decodes each row once.  With
    ``keep_pending_since``, uncommitted manifests created since then (a save
    in flight) are kept with an empty entry, so eviction does not make that
    save's commit fail.
    """
    zero: list[str] = []
    kept = False
    prefix = manifest_prefix(key)
    cur = txn.cursor(db=dbs["manifests"])
    found = cur.set_range(prefix)
    while found and cur.key().startswith(prefix):
        digests, committed, created = _manifest_refs(cur.value())
        if keep_pending_since is not None and not committed and created >= keep_pending_since:
            kept = True
            found = cur.next()
            continue
        zero += _adjust_refs(txn, dbs, digests, -1)
        found = cur.delete()  # moves to the next row
    raw_key = key.encode()
    if entry is None:
        raw = txn.get(raw_key, db=dbs["entries"])
        if raw is not None:
            try:
                entry = Entry.decode(raw_key, raw)
            except CorruptRecord:
                entry = None
    if entry is not None:
        bump(txn, dbs["meta"], LOGICAL, -entry.bytes)
    if kept and entry is not None:
        entry.ranks, entry.bytes = {}, 0
        txn.put(raw_key, entry.encode(), db=dbs["entries"])
        return zero
    txn.delete(raw_key, db=dbs["entries"])
    txn.delete(raw_key, db=dbs["access"])
    txn.delete(raw_key, db=dbs["components"])
    return zero


# Decoded rows, keyed by their LMDB key and checked against their exact bytes:
# a repeated lookup of an unchanged row decodes no JSON.  A plain dict, not
# functools.lru_cache: on thousands of keys looked up at random, the LRU's
# linked-list bookkeeping costs more than the lookup's LMDB reads.  Cleared
# when full; dict operations are atomic under the GIL.
_DECODED_MAX = 1 << 14
_entries_decoded: dict[bytes, tuple[bytes, Entry]] = {}
_manifests_decoded: dict[bytes, tuple[bytes, Manifest, tuple[tuple[bytes, int, str], ...]]] = {}


def _decode_entry_cached(raw_key: bytes, raw: bytes) -> Entry:
    hit = _entries_decoded.get(raw_key)
    if hit is not None and hit[0] == raw:
        return hit[1]
    entry = Entry.decode(raw_key, raw)
    if len(_entries_decoded) >= _DECODED_MAX:
        _entries_decoded.clear()
    _entries_decoded[raw_key] = (raw, entry)
    return entry


def _decode_manifest_cached(raw_key: bytes, raw: bytes) -> tuple[Manifest, tuple[tuple[bytes, int, str], ...]]:
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
    txn: lmdb.Transaction,
    blobs_db: Any,
    checks: tuple[tuple[bytes, int, str], ...],
    file_ok: FileCheck,
    files: list[tuple[str, int]],
) -> str | None:
    """Invariant 5 for one manifest: every blob registered, not quarantined, of its size.

    Rows are unpacked in place (no BlobRow per check); a file blob's size is
    checked on disk by ``file_ok`` (and the blob added to ``files``), an
    inline blob lives in the index itself.
    """
    get = txn.get
    for row_key, size, digest in checks:
        raw = get(row_key, None, blobs_db)
        if raw is None:
            return "blob_missing"
        if len(raw) != BLOB_ROW.size:
            raise CorruptRecord("blobs", digest, f"row of {len(raw)} bytes, expected {BLOB_ROW.size}")
        row_size, _refs, _touched, flags = BLOB_ROW.unpack(raw)
        if flags & FLAG_QUARANTINED or row_size != size:
            return "blob_missing"
        if not flags & FLAG_INLINE:
            if not file_ok(digest, size):
                return "blob_missing"
            files.append((digest, size))
    return None


@dataclass(frozen=True, slots=True)
class _Checked:
    """A hit as checked: the rows it was read from, and its file blobs."""

    entry_raw: bytes
    epoch: bytes | None
    manifests: tuple[tuple[bytes, bytes], ...]  # (manifest key, row bytes) per rank
    files: tuple[tuple[str, int], ...]  # (digest, size) of blobs stored as files
    result: LookupResult


class LookupMemo:
    """The hits one store already checked in this process, reused while provably unchanged.

    A repeated lookup re-reads the entry row, each rank's manifest row and the
    blob epoch (``stats.BLOB_EPOCH``) and compares their bytes with the ones
    the hit was checked against.  The blob rows are not read again: every
    transaction that could fail their check (a row deleted, quarantined or
    given another size) bumps the epoch.  Files are stat'ed every time, since
    they can vanish without the index knowing.  Damage done to the index
    from outside the store cannot bump the epoch; the verified read that
    follows a hit catches it and clears the memo (``Store.get_bytes``).
    Only hits are memoized; a miss is always checked in full.  Bounded;
    cleared when full.
    """

    __slots__ = ("_checked", "_capacity")

    def __init__(self, capacity: int = 1 << 14) -> None:
        self._checked: dict[tuple[str, int | None], _Checked] = {}
        self._capacity = capacity

    def get(self, txn: lmdb.Transaction, dbs: Dbs, key: str, rank: int | None, entry_raw: bytes,
            file_ok: FileCheck) -> LookupResult | None:
        c = self._checked.get((key, rank))
        if c is None or c.entry_raw != entry_raw or txn.get(BLOB_EPOCH, None, dbs["meta"]) != c.epoch:
            return None
        manifests_db = dbs["manifests"]
        for mk, mraw in c.manifests:
            if txn.get(mk, None, manifests_db) != mraw:
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


def lookup_txn(
    txn: lmdb.Transaction,
    dbs: Dbs,
    key: str,
    rank: int | None,
    file_ok: FileCheck,
    memo: LookupMemo | None = None,
) -> LookupResult:
    """Check invariants 5-6 for one rank (``rank``) or the whole entry (``None``).

    The hot path of every model start: two B-tree reads (entry, manifest) plus
    one per blob, with decoded rows reused while their bytes are unchanged
    (see ``_decode_entry_cached``), or fewer with a ``memo``.  The returned
    result, entry and manifests are shared and must be treated as read-only.
    """
    raw_key = key.encode()
    raw = txn.get(raw_key, None, dbs["entries"])
    if raw is None:
        return LookupResult(False, "absent")
    if memo is not None:
        known = memo.get(txn, dbs, key, rank, raw, file_ok)
        if known is not None:
            return known
    entry = _decode_entry_cached(raw_key, raw)
    ranks = (rank,) if rank is not None else range(entry.world_size)
    manifests_db, blobs_db = dbs["manifests"], dbs["blobs"]
    prefix = raw_key + b"\x00"
    found: dict[int, Manifest] = {}
    rows: list[tuple[bytes, bytes]] = []
    files: list[tuple[str, int]] = []
    for r in ranks:
        gen = entry.ranks.get(r)
        if gen is None:
            pending = any(m.rank == r and not m.committed for m in iter_manifests(txn, dbs, key))
            return LookupResult(False, "uncommitted" if pending else "incomplete", entry=entry)
        mk = prefix + MANIFEST_SUFFIX.pack(r, gen)
        mraw = txn.get(mk, None, manifests_db)
        if mraw is None:
            return LookupResult(False, "incomplete", entry=entry)
        m, checks = _decode_manifest_cached(mk, mraw)
        if m.world_size != entry.world_size:
            return LookupResult(False, "generation_mismatch", entry=entry)
        if not m.committed:
            return LookupResult(False, "uncommitted", entry=entry)
        reason = _check_blobs(txn, blobs_db, checks, file_ok, files)
        if reason:
            return LookupResult(False, reason, entry=entry)
        found[r] = m
        rows.append((mk, mraw))
    if len({m.generation for m in found.values()}) > 1:
        return LookupResult(False, "generation_mismatch", entry=entry)
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
        epoch = txn.get(BLOB_EPOCH, None, dbs["meta"])
        memo.put(key, rank, _Checked(raw, epoch, tuple(rows), tuple(files), result))
    return result
