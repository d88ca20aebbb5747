"""The entry tables (``entries``, ``entry_shadow``, ``access``, ``components``) of the typed transaction layer.

A part of :class:`~adstore.store.index.tables.Txn`, kept apart to keep
modules small (as :mod:`.blobrows` is for blobs).  An entry owns its row in
each of :data:`~.schema.ENTRY_TABLES`; :meth:`EntryRows.put_entry` writes it
and :meth:`EntryRows.remove_entries` is the one way it leaves, and
:meth:`EntryRows._entry_totals` the one place its bytes move the logical and
pinned totals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from ..errors import CorruptRow
from .drops import COMMITTED_RECORD, Drops
from .lmdbio import RawTxn
from .rows import ACCESS_ROW, Entry, decode_json, encode_json, manifest_key, manifest_refs
from .schema import ENTRY_TABLES, LOGICAL_BYTES, PINNED_BYTES
from .shadows import entry_shadow, head_of, to_entry

__all__ = ["EntryRows", "Removal"]

log = logging.getLogger(__name__)


class Removal(NamedTuple):
    """An entry to remove: its key's bytes, its share of the totals, and manifests going with it."""

    raw_key: bytes
    nbytes: int  # its logical bytes (0 when unknown: ``verify --fix`` recounts the totals)
    pinned: bool
    manifests: Sequence[bytes] = ()  # keys of manifest rows removed with it (current, committed ones)


class EntryRows:
    """Entry-row methods of :class:`~adstore.store.index.tables.Txn` (a mixin: no state of its own)."""

    __slots__ = ()
    raw: RawTxn
    _db: Mapping[str, Any]
    _add: Callable[[bytes, int], None]  # Txn's (through BlobRows): a total's delta, written before the commit
    _drops: Callable[[], Drops]  # Txn's: what this transaction dropped that has record files

    def entry_row(self, key: bytes) -> bytes | None:
        return self.raw.get(key, None, self._db["entries"])

    def entry(self, key: str) -> Entry | None:
        """The entry of ``key`` with its last access and hits, or None."""
        raw_key = key.encode()
        raw = self.raw.get(raw_key, None, self._db["entries"])
        return None if raw is None else self.with_access(self.entry_of(raw_key, raw))

    def entry_of(self, raw_key: bytes, raw: bytes) -> Entry:
        """The entry row ``raw`` decoded, from its shadow when that was made from this row (no JSON)."""
        shadow = self.shadow(raw_key)
        head = head_of(raw, shadow)
        if head is None:
            return Entry.decode(raw_key, raw)
        try:
            return to_entry(raw_key.decode(), shadow, head)  # type: ignore[arg-type]
        except UnicodeDecodeError:
            return Entry.decode(raw_key, raw)  # raises CorruptRow

    def shadow(self, raw_key: bytes) -> bytes | None:
        """An entry's shadow row as stored (``shadows.head_of`` says whether it is the row's)."""
        return self.raw.get(raw_key, None, self._db["entry_shadow"])

    def current_manifests(self, key: str, ranks: Iterable[tuple[int, int]]) -> list[bytes | None]:
        """The rows of the manifests (rank, generation) of ``key``, None where one is missing."""
        get, manifests = self.raw.get, self._db["manifests"]
        return [get(manifest_key(key, r, g), None, manifests) for r, g in ranks]

    def entry_rows(self, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """(key, row) of every entry, in key order from ``start``."""
        cur = self.raw.cursor(db=self._db["entries"])
        if start and not cur.set_range(start):
            return
        yield from cur

    def entry_scan(
        self,
    ) -> Iterator[tuple[bytes, bytes, bytes | None, bytes | None, tuple[bytes, ...], tuple[bytes, ...]]]:
        """Every entry: (key, row, shadow, access row, its manifests' keys, their rows), in key order.

        One forward pass of four cursors instead of lookups per entry (half
        the time; reading the tables into dicts is slower still): the tables
        share the entries' key order (a manifest key is the entry key, a NUL,
        rank and generation).  How eviction planning reads 100k entries.
        """
        db = self._db
        shadows, accesses, manifests = (self.raw.cursor(db=db[n]) for n in ("entry_shadow", "access", "manifests"))
        s_key = shadows.key() if shadows.first() else None
        a_key = accesses.key() if accesses.first() else None
        m_key = manifests.key() if manifests.first() else None
        for k, raw in self.raw.cursor(db=db["entries"]):
            while s_key is not None and s_key < k:
                s_key = shadows.key() if shadows.next() else None
            while a_key is not None and a_key < k:
                a_key = accesses.key() if accesses.next() else None
            prefix = k + b"\x00"
            while m_key is not None and m_key < prefix:
                m_key = manifests.key() if manifests.next() else None
            keys: list[bytes] = []
            rows: list[bytes] = []
            while m_key is not None and m_key.startswith(prefix):
                keys.append(m_key)
                rows.append(manifests.value())
                m_key = manifests.key() if manifests.next() else None
            yield (
                k,
                raw,
                shadows.value() if s_key == k else None,
                accesses.value() if a_key == k else None,
                tuple(keys),
                tuple(rows),
            )

    def entries(self) -> Iterator[tuple[Entry, bytes]]:
        """Every decodable entry (with its row); undecodable rows are logged and skipped."""
        for k, v in self.entry_rows():
            try:
                yield self.entry_of(k, v), v
            except CorruptRow as exc:
                log.warning("%s", exc)

    def put_entry(self, entry: Entry) -> None:
        """Write an entry row and its shadow; the totals follow the row it replaces."""
        raw_key = entry.key.encode()
        old = self._entry_or_none(raw_key)
        if old is not None:
            self._entry_totals(-old.bytes, -old.bytes if old.pinned else 0)
        self._entry_totals(entry.bytes, entry.bytes if entry.pinned else 0)
        raw = entry.encode()
        rows = self.current_manifests(entry.key, sorted(entry.ranks.items()))
        current = None if None in rows else rows
        refs = [bytes.fromhex(d) for row in current or () for d in manifest_refs(row)[0]]  # type: ignore[arg-type]
        self.raw.put(raw_key, raw, db=self._db["entries"])
        self.raw.put(raw_key, entry_shadow(raw, entry, current, refs), db=self._db["entry_shadow"])  # type: ignore[arg-type]

    def drop_entry(self, key: str, entry: Entry | None = None) -> None:
        """Remove one entry's rows (:meth:`remove_entries`); ``entry`` is its decoded row when the caller has it."""
        raw_key = key.encode()
        entry = entry if entry is not None else self._entry_or_none(raw_key)
        self.remove_entries(
            [Removal(raw_key, entry.bytes, entry.pinned) if entry is not None else Removal(raw_key, 0, False)]
        )

    def remove_entries(self, removals: Sequence[Removal]) -> None:
        """The one way an entry leaves the index: its row in every :data:`ENTRY_TABLES` table goes, with
        the manifests listed, and its share of the totals.

        Each table's rows go in key order through one cursor (LMDB positions
        it from where it is rather than from the root: eviction removes
        thousands per transaction).  Pins and manifests are noted so their
        record files follow after the commit (``records.obsolete``).
        """
        if not removals:
            return
        self._entry_totals(-sum(r.nbytes for r in removals), -sum(r.nbytes for r in removals if r.pinned))
        keys = sorted(r.raw_key for r in removals)
        manifests = sorted(mk for r in removals for mk in r.manifests)
        pins = [r.raw_key for r in removals if r.pinned]
        if manifests or pins:
            drops = self._drops()
            drops.manifests += [(mk, COMMITTED_RECORD) for mk in manifests]
            drops.pins += pins
        for table, rows in [*((t, keys) for t in ENTRY_TABLES), ("manifests", manifests)]:
            cur = self.raw.cursor(db=self._db[table])
            for k in rows:
                if cur.set_key(k):
                    cur.delete()

    def _entry_totals(self, nbytes: int, pinned_bytes: int) -> None:
        """The one place entries move the totals: ``nbytes`` logical bytes, ``pinned_bytes`` of them pinned."""
        self._add(LOGICAL_BYTES, nbytes)
        self._add(PINNED_BYTES, pinned_bytes)

    def is_pinned(self, raw_key: bytes) -> bool:
        """Whether the entry of ``raw_key`` exists, is readable and is pinned."""
        entry = self._entry_or_none(raw_key)
        return entry is not None and entry.pinned

    def _entry_or_none(self, raw_key: bytes) -> Entry | None:
        raw = self.raw.get(raw_key, None, self._db["entries"])
        if raw is None:
            return None
        try:
            return self.entry_of(raw_key, raw)
        except CorruptRow:
            return None

    def access(self, raw_key: bytes) -> tuple[float, int] | None:
        """(last access, hits) from the entry's ``access`` row; None if absent or unreadable."""
        raw = self.raw.get(raw_key, None, self._db["access"])
        return ACCESS_ROW.unpack(raw) if raw is not None and len(raw) == ACCESS_ROW.size else None

    def with_access(self, entry: Entry) -> Entry:
        """Fill in ``entry``'s last access and hits from its ``access`` row (if readable)."""
        access = self.access(entry.key.encode())
        if access is not None:
            entry.last_access, entry.hits = access
        return entry

    def put_access(self, key: str, when: float, hits: int) -> None:
        self.raw.put(key.encode(), ACCESS_ROW.pack(when, hits), db=self._db["access"])

    def strays(self) -> dict[str, list[bytes]]:
        """Keys of rows whose entry is gone (access rows, shadows), by table."""
        owners = {"access": "entries", "entry_shadow": "entries"}
        return {
            table: [
                k
                for k in self.raw.cursor(db=self._db[table]).iternext(values=False)
                if self.raw.get(k, None, self._db[owner]) is None
            ]
            for table, owner in owners.items()
        }

    def drop_row(self, table: str, key: bytes) -> None:
        """Delete one row of ``table`` (for ``verify --fix``: strays)."""
        self.raw.delete(key, db=self._db[table])

    def components(self, key: str) -> dict[str, Any]:
        raw = self.raw.get(key.encode(), None, self._db["components"])
        return {} if raw is None else decode_json(raw, "components", key.encode())

    def put_components(self, key: str, components: Mapping[str, Any]) -> None:
        if components:
            self.raw.put(key.encode(), encode_json(dict(components)), db=self._db["components"])
