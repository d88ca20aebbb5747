"""Manifest and entry operations inside one LMDB transaction.

A save publishes each rank's manifest *uncommitted*, with the blob refcounts
bumped in the same transaction (invariant 3), and commits it only when every
rank saved.  Committing a generation replaces the rank's older generation and
releases its blob references.  Lookup checks invariants 5 and 6 and names the
reason of every miss.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import lmdb

from .errors import BlobMissing, CorruptRecord, StoreError
from .leases import hostname
from .records import FLAG_QUARANTINED, BlobRef, BlobRow, Entry, Manifest, decode_json, encode_json, manifest_key, manifest_prefix
from .stats import LOGICAL, bump

__all__ = [
    "LookupResult",
    "publish_txn",
    "commit_txn",
    "drop_manifest_txn",
    "drop_entry_txn",
    "iter_manifests",
    "get_entry",
    "get_components",
    "lookup_txn",
]

Dbs = Mapping[str, Any]


@dataclass(slots=True)
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
    raw_key = key.encode()
    raw = txn.get(raw_key, db=dbs["entries"])
    return None if raw is None else Entry.decode(raw_key, raw)


def get_components(txn: lmdb.Transaction, dbs: Dbs, key: str) -> dict[str, Any]:
    raw = txn.get(key.encode(), db=dbs["components"])
    return {} if raw is None else decode_json(raw, "components", key.encode())


def _put_components(txn: lmdb.Transaction, dbs: Dbs, key: str, components: Mapping[str, Any]) -> None:
    if components:
        txn.put(key.encode(), encode_json(dict(components)), db=dbs["components"])


def iter_manifests(txn: lmdb.Transaction, dbs: Dbs, key: str) -> Iterator[Manifest]:
    prefix = manifest_prefix(key)
    cur = txn.cursor(db=dbs["manifests"])
    if not cur.set_range(prefix):
        return
    for raw_key, raw in cur:
        if not raw_key.startswith(prefix):
            break
        yield Manifest.decode(bytes(raw_key), bytes(raw))


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
    blob_ok: Callable[[BlobRef, BlobRow], bool],
) -> Manifest:
    """Record an uncommitted manifest and take references on its blobs."""
    for ref in artifacts.values():
        k = bytes.fromhex(ref.digest)
        raw = txn.get(k, db=dbs["blobs"])
        if raw is None:
            raise BlobMissing(ref.digest, "not registered (put it before publishing)")
        row = BlobRow.decode(raw, k)
        if row.size != ref.size or row.quarantined or not blob_ok(ref, row):
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
    entry.last_access = now
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
    txn.delete(raw_key, db=dbs["components"])
    return zero


@functools.lru_cache(maxsize=8192)
def _decode_entry_cached(raw_key: bytes, raw: bytes) -> Entry:
    return Entry.decode(raw_key, raw)


@functools.lru_cache(maxsize=8192)
def _decode_manifest_cached(raw_key: bytes, raw: bytes) -> Manifest:
    return Manifest.decode(raw_key, raw)


def _check_manifest(
    txn: lmdb.Transaction, dbs: Dbs, m: Manifest, blob_ok: Callable[[BlobRef, BlobRow], bool]
) -> str | None:
    if not m.committed:
        return "uncommitted"
    blobs_db = dbs["blobs"]
    for ref in m.artifacts.values():
        k = bytes.fromhex(ref.digest)
        raw = txn.get(k, db=blobs_db)
        if raw is None:
            return "blob_missing"
        row = BlobRow.decode(raw, k)
        if row.flags & FLAG_QUARANTINED or row.size != ref.size or not blob_ok(ref, row):
            return "blob_missing"
    return None


def lookup_txn(
    txn: lmdb.Transaction,
    dbs: Dbs,
    key: str,
    rank: int | None,
    blob_ok: Callable[[BlobRef, BlobRow], bool],
) -> LookupResult:
    """Check invariants 5-6 for one rank (``rank``) or the whole entry (``None``).

    Rows are decoded through a small cache keyed by their exact bytes (a
    repeated lookup of an unchanged entry decodes no JSON); the returned
    entry and manifests are shared and must be treated as read-only.
    """
    raw_key = key.encode()
    raw = txn.get(raw_key, db=dbs["entries"])
    if raw is None:
        return LookupResult(False, "absent")
    entry = _decode_entry_cached(raw_key, raw)
    ranks = [rank] if rank is not None else list(range(entry.world_size))
    found: dict[int, Manifest] = {}
    for r in ranks:
        gen = entry.ranks.get(r)
        if gen is None:
            pending = any(m.rank == r and not m.committed for m in iter_manifests(txn, dbs, key))
            return LookupResult(False, "uncommitted" if pending else "incomplete", entry=entry)
        mk = manifest_key(key, r, gen)
        mraw = txn.get(mk, db=dbs["manifests"])
        if mraw is None:
            return LookupResult(False, "incomplete", entry=entry)
        m = _decode_manifest_cached(mk, mraw)
        if m.world_size != entry.world_size:
            return LookupResult(False, "generation_mismatch", entry=entry)
        reason = _check_manifest(txn, dbs, m, blob_ok)
        if reason:
            return LookupResult(False, reason, entry=entry)
        found[r] = m
    generations = {m.generation for m in found.values()}
    if len(generations) > 1:
        return LookupResult(False, "generation_mismatch", entry=entry)
    first = found[ranks[0]]
    return LookupResult(
        True,
        None,
        manifest=first if rank is not None or len(found) == 1 else found.get(0, first),
        manifests=found,
        generation=first.generation,
        entry=entry,
    )
