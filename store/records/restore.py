"""Entries, manifests, refcounts and inline blobs again from the on-disk records (invariant 9).

What a rebuild (``rebuild``) does once the blob files are registered: read
every committed record, keep those whose blobs are intact (a file that
hashed to its name, or inline bytes in the record that hash to their
digest), choose one generation per key, and write the committed manifests,
their blob references, the inline blobs, the entry, its components and its
pin into the fresh index.  Skipped records are reported with a
:class:`~.reasons.Reason` and a sentence, never raised.

The choice per key: the newest generation that every rank of its world size
has a record of (so a crash between two ranks' commits restores the older
complete generation, as the index would have served it); failing that,
each rank's newest record of the newest world size (a lookup then misses
with ``generation_mismatch`` or ``incomplete``, as it did before the index
was lost).  LRU order and hit counts are not in the records: an entry's last
access becomes its newest record's creation time.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..codec import Encoding
from ..errors import BlobMissing, ChecksumMismatch, CorruptRow
from ..index.rows import FLAG_INLINE, FLAG_ZSTD, BlobRow, Entry, pack_inline
from ..index.tables import Tables, Txn
from ..lookup import lookup
from ..manifests import drop_entry
from ..reading import DAMAGE, VerifiedRead, open_blob
from ..reasons import Reason
from .files import Found, RecordFiles, RecordState
from .format import BadRecord, Record

__all__ = ["Skipped", "Restored", "BlobFile", "choose", "read_records", "restore", "reimport", "identify_blob_file"]

log = logging.getLogger(__name__)

_BATCH = 200  # keys per write transaction


class BlobFile(NamedTuple):
    """A blob file found intact: what it decodes to (digest, size), how it holds it, what it takes on disk."""

    digest: str
    size: int
    encoding: Encoding
    stored: int


def identify_blob_file(path: Path) -> BlobFile | None:
    """What the blob file ``path`` holds, read without following a symlink; None if it is no intact blob.

    Its name is its digest: a raw file hashes to it, compressed frames
    (``codec``) decode to bytes that do, bounded by the sizes their seek
    table records.  Read through the one read path (``reading``): a file
    that could not be read (out of descriptors, an I/O error) raises
    :class:`~.errors.BlobUnreadable`, since it may well be intact.
    """
    try:
        fd = open_blob(path, path.name)
    except (BlobMissing, *DAMAGE):  # gone, a symlink, not a regular file
        return None
    try:
        for encoding in (Encoding.RAW, Encoding.ZSTD):
            read = VerifiedRead(fd, path.name, encoding=encoding, size=None)
            try:
                for _ in read.chunks():
                    pass
            except ChecksumMismatch:
                continue
            return BlobFile(path.name, read.size, encoding, os.fstat(fd).st_size)
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Skipped:
    """A record file that was not restored, and why."""

    path: str
    reason: Reason
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.detail} ({self.reason})"


@dataclass
class Restored:
    """What :func:`restore` wrote into the index."""

    entries: int = 0
    manifests: int = 0
    inline_blobs: int = 0
    pinned: int = 0
    skipped: list[Skipped] = field(default_factory=list)


def read_records(
    files: RecordFiles, found: Iterable[Found], intact: Mapping[str, BlobFile]
) -> tuple[dict[str, list[Record]], set[str], list[Skipped]]:
    """The committed records whose blobs are all there (``intact``: the good blob files by digest), by key.

    Also the keys with a pin marker, and every record file skipped.
    Pending records (published, never committed) are not restored.
    """
    by_key: dict[str, list[Record]] = defaultdict(list)
    pins: set[str] = set()
    skipped: list[Skipped] = []
    for f in found:
        if f.state is RecordState.PIN:
            pins.add(f.key)
            continue
        if f.state is RecordState.PENDING:
            continue
        if f.state is RecordState.UNKNOWN:
            skipped.append(Skipped(str(f.path), Reason.CORRUPT_RECORD, "not a record the store writes"))
            continue
        try:
            record = files.read_found(f)
        except BadRecord as exc:
            skipped.append(Skipped(str(f.path), exc.reason, exc.detail))
            continue
        missing = [
            ref.digest
            for ref in record.artifacts.values()
            if _size(intact, ref.digest) != ref.size and ref.digest not in record.inline
        ]
        if missing:
            skipped.append(
                Skipped(
                    str(f.path),
                    Reason.BLOB_MISSING,
                    f"blob {missing[0]} of {record.key} rank {record.rank} is missing or corrupt",
                )
            )
            continue
        by_key[record.key].append(record)
    return by_key, pins, skipped


def choose(records: list[Record]) -> list[Record]:
    """The records of one key to restore, one per rank (see the module's docstring)."""
    newest_first = sorted(records, key=lambda r: (r.created, r.generation), reverse=True)
    by_gen: dict[int, dict[int, Record]] = defaultdict(dict)
    for r in newest_first:
        by_gen[r.generation].setdefault(r.rank, r)
    for r in newest_first:  # generations, newest first
        ranks = by_gen[r.generation]
        ws = r.world_size
        if all(k in ranks and ranks[k].world_size == ws for k in range(ws)):
            return [ranks[k] for k in range(ws)]
    ws = newest_first[0].world_size
    chosen: dict[int, Record] = {}
    for r in newest_first:
        if r.world_size == ws:
            chosen.setdefault(r.rank, r)
    return [chosen[k] for k in sorted(chosen)]


def _size(intact: Mapping[str, BlobFile], digest: str) -> int | None:
    found = intact.get(digest)
    return None if found is None else found.size


def restore(
    tables: Tables,
    files: RecordFiles,
    found: Iterable[Found],
    intact: Mapping[str, BlobFile],
    *,
    replace_broken: bool = False,
) -> Restored:
    """Write the chosen records of every key into ``tables``; ``intact``: the good blob files by digest.

    In a fresh index (a rebuild) every key is new.  With ``replace_broken``
    (``verify --fix`` after an in-place repair) a key whose entry is a hit
    is left alone, and an entry that is not is dropped and restored whole.
    A blob without a usable row gets one: inline from the record's bytes,
    or a file from ``intact``.
    """
    by_key, pins, skipped = read_records(files, found, intact)
    out = Restored(skipped=skipped)
    keys = sorted(by_key)
    now = tables.clock()
    file_ok = tables.layout.has_file
    for i in range(0, len(keys), _BATCH):

        def fn(t: Txn, batch: list[str] = keys[i : i + _BATCH]) -> tuple[int, int, int, int]:
            counts = [0, 0, 0, 0]
            for key in batch:
                if replace_broken and t.entry_row(key.encode()) is not None:
                    if lookup(t, key, None, file_ok).hit:
                        continue
                    t.release_counts(Counter(drop_entry(t, key)))
                chosen = choose(by_key[key])
                for record in chosen:
                    counts[2] += _register_blobs(t, record, intact, now)
                    manifest = record.manifest()
                    t.hold(manifest.digests())
                    t.put_manifest(manifest)
                    counts[1] += 1
                first = chosen[0]
                created = min(r.created for r in chosen)
                last = max(r.created for r in chosen)
                entry = Entry(
                    key,
                    first.namespace,
                    first.world_size,
                    {},
                    created,
                    last,
                    0,
                    sum(r.manifest().bytes for r in chosen),
                    {r.rank: r.generation for r in chosen},
                    key in pins,
                )
                t.put_entry(entry)
                t.put_access(key, last, 0)
                t.put_components(key, first.components)
                counts[0] += 1
                counts[3] += entry.pinned
            return counts[0], counts[1], counts[2], counts[3]

        entries, manifests, inline, pinned = tables.write(fn)
        out.entries += entries
        out.manifests += manifests
        out.inline_blobs += inline
        out.pinned += pinned
    log.info(
        "restored %d entr(ies), %d manifest(s) from records; skipped %d record file(s)",
        out.entries,
        out.manifests,
        len(skipped),
    )
    return out


def _register_blobs(t: Txn, record: Record, intact: Mapping[str, BlobFile], now: float) -> int:
    """Give each blob of ``record`` a usable row (keeping its references); returns inline blobs written."""
    written = 0
    for ref in record.artifacts.values():
        digest = ref.digest
        try:
            row = t.blob_row(digest)
        except CorruptRow:
            row = None
        if row is not None and not row.quarantined and (not row.inline or t.inline_value(digest) is not None):
            continue
        held = row.refs if row is not None else 0
        data = record.inline.get(digest)
        found = intact.get(digest)
        if data is not None:
            t.put_blob(digest, BlobRow(len(data), held, now, FLAG_INLINE, len(data)), inline=pack_inline(data))
            written += 1
        elif found is not None and found.size == ref.size:
            flags = FLAG_ZSTD if found.encoding is Encoding.ZSTD else 0
            t.put_blob(digest, BlobRow(ref.size, held, now, flags, found.stored), inline=None)
    return written


def reimport(tables: Tables, files: RecordFiles, keys: Iterable[str], intact: Mapping[str, BlobFile]) -> Restored:
    """Restore ``keys`` from their records into a sound index whose rows for them ``verify --fix`` dropped.

    Blob files a record needs that ``intact`` does not list (a row that was
    lost) are hashed here and used if they hash to their name.
    """
    found = [f for key in sorted(set(keys)) for f in files.scan_key(key)]
    needed = set()
    for f in found:
        if f.state is RecordState.COMMITTED:
            try:
                needed |= {r.digest for r in files.read_found(f).artifacts.values()}
            except BadRecord:
                continue
    known = dict(intact)
    for digest in sorted(needed - set(known)):
        got = identify_blob_file(tables.layout.blob_path(digest))
        if got is not None:
            known[digest] = got
    return restore(tables, files, found, known, replace_broken=True)
