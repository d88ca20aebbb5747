"""Saving an entry: publish each rank's manifest, commit, abort, and drop whole entries.

A save publishes each rank's manifest *uncommitted*, with the blob refcounts
bumped in the same transaction (invariant 3), and commits it only when every
rank saved.  Committing a generation replaces the rank's older generation and
releases its blob references.  Dropping an entry takes every rank and every
generation with it (invariant 4).  All of it runs inside one
:class:`~adstore.store.index.tables.Txn` (docs/architecture.md, "How an entry lives").
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import BlobMissing, CorruptRow, InvalidKey, KeyNotFound, ManifestGone, StoreError
from .index.entryrows import Removal
from .index.rows import BlobRef, Entry, Manifest, manifest_key, validate_json
from .index.shadows import PINNED, Head, to_entry
from .index.tables import Txn
from .leases import DEFAULT_PUBLISH_TIMEOUT, in_flight, publisher
from .names import (
    validate_artifact_name,
    validate_generation,
    validate_key,
    validate_namespace,
    validate_rank,
    validate_world_size,
)

__all__ = ["FileCheck", "validate_publish", "publish", "commit", "abort", "drop_entry", "drop_if_empty", "set_pinned"]

#: ``file_ok(digest, size)``: is the blob file of that digest on disk with that size?
FileCheck = Callable[[str, int], bool]


def validate_publish(
    key: str,
    *,
    rank: object,
    world_size: object,
    generation: object,
    artifacts: Mapping[str, object],
    namespace: str,
    components: Mapping[str, Any] | None,
    meta: Mapping[str, Any] | None,
) -> None:
    """Refuse a publish whose arguments could not be stored as given (:class:`InvalidKey`), before any write."""
    validate_key(key)
    validate_namespace(namespace)
    validate_rank(rank, validate_world_size(world_size))
    validate_generation(generation)
    validate_json(components or {}, "components")
    validate_json(meta or {}, "meta")
    for name, ref in artifacts.items():
        validate_artifact_name(name)
        if not isinstance(ref, BlobRef):
            raise InvalidKey(ref, f"artifact {name!r} must be a BlobRef")


def publish(
    t: Txn,
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
    timeout: float = DEFAULT_PUBLISH_TIMEOUT,
) -> Manifest:
    """Record an uncommitted manifest and take references on its blobs; gc waits ``timeout`` seconds at most
    for its commit while this process runs (:func:`~.leases.in_flight`)."""
    for ref in artifacts.values():
        row = t.blob_row(ref.digest)
        if row is None:
            raise BlobMissing(ref.digest, "not registered (put it before publishing)")
        if row.size != ref.size or row.quarantined or not (row.inline or file_ok(ref.digest, row.stored)):
            raise BlobMissing(ref.digest, "absent, quarantined or of the wrong size")
    old = t.manifest(key, rank, generation)
    if old is not None:
        if old.committed:
            raise StoreError(f"{key} rank {rank} generation {generation} is already committed")
        t.release(old.digests())
    now = t.clock()
    manifest = Manifest(
        key=key,
        rank=rank,
        world_size=world_size,
        generation=generation,
        artifacts=dict(artifacts),
        committed=False,
        namespace=namespace,
        producer=publisher(now + timeout),  # gc leaves it alone while this process runs, until then
        created=now,
        meta=dict(meta),
    )
    t.hold(manifest.digests())
    t.put_manifest(manifest)
    if t.entry_row(key.encode()) is None:
        t.put_entry(Entry(key, namespace, world_size, {}, now, now))
        t.put_access(key, now, 0)
        t.put_components(key, components)
    return manifest


def commit(
    t: Txn, *, key: str, rank: int, generation: int, components: Mapping[str, Any] | None = None
) -> tuple[Manifest, list[str]]:
    """Mark a manifest committed and make it the rank's current generation.

    Returns the manifest and the digests whose refcount dropped to zero
    because the older generation was released.
    """
    manifest = t.manifest(key, rank, generation)
    if manifest is None:
        raise ManifestGone(key, rank, generation)
    manifest.committed = True
    t.put_manifest(manifest)
    now = t.clock()
    entry = t.entry(key) or Entry(key, manifest.namespace, manifest.world_size, {}, now, now)
    zero: list[str] = []
    old_gen = entry.ranks.get(rank)
    if old_gen is not None and old_gen != generation:
        zero += _release_generation(t, key, rank, old_gen)
    entry.ranks[rank] = generation
    # A new topology: ranks beyond the new world size belong to an old save.
    for r in [r for r in entry.ranks if r >= manifest.world_size]:
        zero += _release_generation(t, key, r, entry.ranks.pop(r))
    entry.world_size = manifest.world_size
    entry.namespace = manifest.namespace
    if components is not None:
        t.put_components(key, components)
    t.put_access(key, now, entry.hits)
    new_bytes = 0
    for r, g in entry.ranks.items():
        m = manifest if r == rank else t.manifest(key, r, g)
        new_bytes += m.bytes if m is not None else 0
    entry.bytes = new_bytes
    t.put_entry(entry)
    return manifest, zero


def _release_generation(t: Txn, key: str, rank: int, generation: int) -> list[str]:
    """Drop a superseded manifest; a row that no longer decodes is deleted as is.

    A damaged old row must not block every later save of its key; its blob
    references cannot be read back, so ``verify --fix`` recounts them.
    """
    try:
        old = t.manifest(key, rank, generation)
    except CorruptRow:
        t.drop_manifest_row(manifest_key(key, rank, generation))
        return []
    return t.drop_manifest(old) if old is not None else []


def abort(t: Txn, *, key: str, rank: int, generation: int) -> bool:
    """Drop an uncommitted manifest (a failed save); returns whether one was dropped."""
    m = t.manifest(key, rank, generation)
    if m is None or m.committed:
        return False
    t.drop_manifest(m)
    drop_if_empty(t, key)
    return True


def drop_if_empty(t: Txn, key: str) -> None:
    """Drop an entry that has no committed rank and no manifest left (an abandoned save)."""
    entry = t.entry(key)
    if entry is not None and not entry.ranks and not any(True for _ in t.manifest_rows(key)):
        t.drop_entry(key, entry)


def _in_flight_row(mk: bytes, raw: bytes, now: float) -> bool:
    """Whether the uncommitted manifest row ``raw`` belongs to a save in flight at ``now`` (undecodable: no)."""
    try:
        m = Manifest.decode(mk, raw)
        return in_flight(m.producer, m.created, now)
    except CorruptRow:
        return False


def drop_entry(
    t: Txn,
    key: str,
    entry: Entry | None = None,
    *,
    keep_pending_since: float | None = None,
    now: float = 0.0,
    shadow: tuple[bytes, Head] | None = None,
) -> Sequence[bytes]:
    """Delete an entry with all its manifests (every rank, every generation).

    Returns the blob references the manifests held (32-byte digests, one
    per manifest and digest), for the caller to release (a batch releases
    them once).
    ``entry`` is the decoded row when the caller has it, ``shadow`` its
    shadow and head (see :meth:`Txn.take_manifests_of`).  With
    ``keep_pending_since``, uncommitted manifests created since then, or
    published by a process that still runs here before its publish deadline
    at ``now`` (a save in flight, :func:`~.leases.in_flight`), are kept with
    an empty entry, so eviction does not make that save's commit fail.
    """
    live = functools.partial(_in_flight_row, now=now)
    taken, kept = t.take_manifests_of(key, keep_pending_since=keep_pending_since, shadow=shadow, in_flight=live)
    if entry is None and shadow is not None:
        if not kept:  # the usual case: no objects needed
            head = shadow[1]
            t.remove_entries([Removal(key.encode(), head[2], bool(head[3] & PINNED))])
            return taken
        entry = to_entry(key, *shadow)
    if entry is None:
        try:
            entry = t.entry(key)
        except CorruptRow:
            entry = None
    if kept and entry is not None:
        t.put_entry(dataclasses.replace(entry, ranks={}, bytes=0))
    else:
        t.drop_entry(key, entry)
    return taken


def set_pinned(t: Txn, key: str, pinned: bool) -> None:
    """Pin (exclude from eviction) or unpin ``key``'s entry; :class:`KeyNotFound` when there is none."""
    entry = t.entry(key)
    if entry is None:
        raise KeyNotFound(key)
    entry.pinned = pinned
    t.put_entry(entry)
