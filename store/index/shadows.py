"""Binary shadows of the JSON entry rows, for passes over many entries.

Entries and manifests are JSON so that ``adstore inspect`` and people can
read them, but decoding JSON (and building objects from it) is what bounded a
pass over 100k entries: eviction read every entry and every victim's
manifests, twice.  Each entry row therefore has a shadow under the same key
in ``entry_shadow``: the entry's fields and the blob references of its
current manifests, packed, with the xxh3-64 of the entry row and of those
manifest rows it was made from.  A shadow is only believed for an entry row
whose checksum it carries, and its references only for manifest rows whose
checksum it carries; anything else (a row rewritten by other means, an index
written before shadows existed) is decoded from its JSON: the JSON rows stay
the only truth (docs/architecture.md, "The LMDB tables").
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

from xxhash import xxh3_64_intdigest

from .rows import Entry

__all__ = ["HEAD", "PINNED", "Head", "entry_shadow", "head_of", "rows_check", "to_entry", "ranks_of", "refs_of"]

#: Checksum of the entry row, created, bytes, flags, world size, namespace length, number of
#: ranks, checksum of the current manifest rows, number of references; then the namespace
#: (UTF-8), one (rank, generation) pair per rank and one 32-byte digest per reference.
HEAD = struct.Struct("<QdqBIBHQI")
_RANK = struct.Struct("<IQ")
PINNED, _REFS = 1, 2  # flags: pinned; the references describe the current manifests

#: A shadow's unpacked head: check, created, bytes, flags, world_size, ns_len, n_ranks, manifests_check, n_refs.
Head = tuple[int, float, int, int, int, int, int, int, int]


def rows_check(rows: Sequence[bytes]) -> int:
    """The checksum of manifest rows, in key order (each length-prefixed, so no two lists collide)."""
    if len(rows) == 1:  # the usual entry: one rank
        return xxh3_64_intdigest(len(rows[0]).to_bytes(4, "little") + rows[0])
    return xxh3_64_intdigest(b"".join(len(r).to_bytes(4, "little") + r for r in rows))


def entry_shadow(raw: bytes, entry: Entry, manifests: Sequence[bytes] | None, refs: Iterable[bytes]) -> bytes:
    """The shadow of entry row ``raw`` (encoding ``entry``).

    ``manifests``: the rows of its current manifests in rank order, ``refs``
    every blob reference they hold (one 32-byte digest per manifest and
    digest); ``manifests`` None when a current manifest is missing.
    """
    ns = entry.namespace.encode()
    body = b"".join(refs) if manifests is not None else b""
    flags = (PINNED if entry.pinned else 0) | (_REFS if manifests is not None else 0)
    head = HEAD.pack(
        xxh3_64_intdigest(raw),
        entry.created,
        entry.bytes,
        flags,
        entry.world_size,
        len(ns),
        len(entry.ranks),
        rows_check(manifests or ()),
        len(body) // 32,
    )
    return head + ns + b"".join(_RANK.pack(r, g) for r, g in sorted(entry.ranks.items())) + body


def head_of(raw: bytes, shadow: bytes | None) -> Head | None:
    """The head of ``shadow`` if it was made from entry row ``raw`` (and is whole), else None."""
    if shadow is None or len(shadow) < HEAD.size:
        return None
    head: Head = HEAD.unpack_from(shadow)
    if head[0] != xxh3_64_intdigest(raw) or len(shadow) != HEAD.size + head[5] + head[6] * _RANK.size + 32 * head[8]:
        return None
    return head


def ranks_of(shadow: bytes, head: Head) -> list[tuple[int, int]]:
    """(rank, generation) of each current manifest, in rank order."""
    at = HEAD.size + head[5]
    return list(_RANK.iter_unpack(shadow[at : at + head[6] * _RANK.size]))


def refs_of(shadow: bytes, head: Head, manifests: Sequence[bytes | None]) -> tuple[bytes, ...] | None:
    """The references (32-byte digests) of the current manifests, if ``manifests`` are the rows shadowed."""
    if not head[3] & _REFS or None in manifests or rows_check(manifests) != head[7]:  # type: ignore[arg-type]
        return None
    at = HEAD.size + head[5] + head[6] * _RANK.size
    if head[8] == 1:  # the usual manifest of one blob
        return (shadow[at:],)
    return tuple([shadow[i : i + 32] for i in range(at, len(shadow), 32)])  # a tuple: not tracked by the GC


def to_entry(key: str, shadow: bytes, head: Head) -> Entry:
    """The entry a shadow describes (last access and hits as in :meth:`Entry.decode`: filled in later)."""
    at = HEAD.size + head[5]
    return Entry(
        key,
        shadow[HEAD.size : at].decode(),
        head[4],
        {},
        head[1],
        head[1],
        0,
        head[2],
        dict(ranks_of(shadow, head)),
        bool(head[3] & PINNED),
    )
