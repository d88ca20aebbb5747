"""Eviction and removal of whole entries: a frozen plan first, then ``execute()``.

Eviction works on whole entries (every rank, every generation of a cache
key), least recently used first, and never on single blobs under a live
manifest (invariant 4).  Execution re-checks each victim inside the write
transaction of its batch (still unleased; for eviction also unpinned, not
used or recommitted since the plan), deletes the rows, commits, and only then
unlinks files (``blobs.unlink_dropped``, ``obsolete.obsolete_dropped``).  A blob that loses its
last reference is deleted only when it is older than the grace period;
otherwise the sweep takes it later (docs/architecture.md, "How an entry lives").
"""

from __future__ import annotations

import enum
import logging
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter
from typing import Any, NamedTuple

from ..blobs import unlink_dropped
from ..errors import CorruptRow, KeyNotFound
from ..index.ballast import spending_allowed
from ..index.drops import Drops
from ..index.entryrows import Removal
from ..index.rows import ACCESS_ROW, BLOB_ROW, BlobRef, BlobRow, Entry, manifest_refs
from ..index.schema import PHYSICAL_BYTES
from ..index.shadows import HEAD, PINNED, Head, head_of, ranks_of, refs_of, to_entry
from ..index.tables import Tables, Txn
from ..leases import live_leases
from ..manifests import drop_entry
from ..names import validate_key
from ..records.files import RecordFiles
from ..records.obsolete import obsolete_dropped, write_obsolete_list
from ..units import MinFree, parse_min_free

__all__ = ["PlanKind", "EvictedBatch", "EvictionPlan", "Evictor", "Victim", "drop_unreferenced"]

log = logging.getLogger(__name__)


class PlanKind(enum.StrEnum):
    """What a plan does with its victims."""

    EVICT = "evict"  # budget or age: skips victims used, pinned or recommitted since the plan
    REMOVE = "remove"  # asked for by name (``adstore rm``): only a live lease spares a victim


@dataclass(frozen=True, slots=True)
class EvictedBatch:
    """What one write transaction of :meth:`EvictionPlan.execute` did."""

    keys: tuple[str, ...]  # the entries evicted (victims that no longer qualified are not here)
    bytes_freed: int  # physical bytes whose rows were deleted


class Victim(NamedTuple):
    """An entry as a plan read it: enough to remove it later without reading it again.

    A named tuple of atoms: a plan may hold 100k, and the garbage collector
    stops tracking tuples of atoms.  ``head`` is the entry's shadow head when
    the shadow describes this very row (else None, and ``entry`` is the
    decoded row); ``manifests`` are the keys of all its manifests when its
    shadow describes every one of them (else None: execution reads them
    again); ``refs`` are the blob references of all its manifests (32-byte
    digests, one per manifest and digest).
    """

    last_access: float
    key: str
    raw_key: bytes
    row: bytes
    shadow: bytes | None
    head: Head | None
    entry: Entry | None
    hits: int
    manifests: tuple[bytes, ...] | None
    refs: tuple[bytes, ...]

    @property
    def exact(self) -> bool:
        """Whether the plan knows every row the entry owns (it can go without being read again)."""
        return self.head is not None and self.manifests is not None


@dataclass(frozen=True)
class EvictionPlan:
    """Entries to evict or remove and the physical bytes doing so frees now.

    ``victims`` (in eviction order) are built on first use: the daemon's
    passes never need them as objects.
    """

    kind: PlanKind
    blobs: list[BlobRef]
    bytes_to_free: int
    why: str
    skipped: list[str] = field(default_factory=list)
    _victims: Sequence[Victim] = field(default=(), repr=False, compare=False)
    _evictor: Evictor | None = field(default=None, repr=False, compare=False)
    #: The index's write count when the plan was read (``tables.WRITES``).
    _writes: int = field(default=-1, repr=False, compare=False)
    _entries: list[Entry] | None = field(default=None, repr=False, compare=False)

    @property
    def count(self) -> int:
        """How many victims the plan has."""
        return len(self._victims)

    @property
    def victims(self) -> list[Entry]:
        """The victims' entries (with last access and hits as planned); treat as read-only."""
        entries = self._entries
        if entries is None:
            entries = [_entry_of(v) for v in self._victims]
            object.__setattr__(self, "_entries", entries)
        return entries

    def execute(
        self,
        *,
        batch_size: int | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_batch: Callable[[EvictedBatch], bool | None] | None = None,
    ) -> int:
        """Carry the plan out, ``batch_size`` victims per write transaction; returns bytes freed.

        ``should_stop()`` is asked before each batch (SIGTERM finishes the
        current one); ``on_batch(batch)`` returning True ends early (a
        target reached).  Without ``batch_size`` the plan is one batch.
        """
        if self._evictor is None or not self._victims:
            return 0
        total = len(self._victims)
        size = batch_size or total
        freed = evicted = 0
        expected: int | None = self._writes  # the write count if nobody else wrote since the plan
        carried = Drops()  # the records a batch dropped, listed as obsolete by the next one
        try:
            for start in range(0, total, size):
                if should_stop is not None and should_stop():
                    break
                batch, expected = self._evictor.execute(
                    self.kind, self._victims[start : start + size], expected=expected, carried=carried
                )
                freed += batch.bytes_freed
                evicted += len(batch.keys)
                if on_batch is not None and on_batch(batch):
                    break
        finally:
            if carried:  # the last batch's, or one a failed batch did not list
                obsolete_dropped(self._evictor.tables, carried)
        log.info("%s: %d of %d planned entr(ies), freed %d bytes", self.kind, evicted, total, freed)
        return freed

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "reason": self.why,
            "victims": [v.key for v in self._victims],
            "blobs": len(self.blobs),
            "bytes_to_free": self.bytes_to_free,
            "skipped": list(self.skipped),
        }


def _entry_of(v: Victim) -> Entry:
    if v.head is not None and v.shadow is not None:
        entry = to_entry(v.key, v.shadow, v.head)
    else:
        assert v.entry is not None  # a victim without a usable shadow carries its decoded row
        entry = v.entry
    entry.last_access, entry.hits = v.last_access, v.hits
    return entry


def drop_unreferenced(t: Txn, digests: Iterable[str], now: float, grace: float) -> list[tuple[str, BlobRow]]:
    """Drop the rows of blobs that have no reference and are older than the grace period; returns them."""
    dropped: list[tuple[str, BlobRow]] = []
    for digest in digests:
        row = t.blob_row(digest)
        if row is None or row.refs != 0 or now - row.touched < grace:
            continue
        t.drop_blob(digest, row)
        dropped.append((digest, row))
    return dropped


class Evictor:
    """Plans and executes eviction and removal for one store."""

    def __init__(self, tables: Tables, *, grace_period: float) -> None:
        self._tables = tables
        self._files = RecordFiles(tables.layout)
        self.grace = grace_period

    @property
    def tables(self) -> Tables:
        return self._tables

    # -- planning ---------------------------------------------------------------
    def plan(
        self,
        *,
        max_size: int | None = None,
        min_free: MinFree | int | str | None = None,
        older_than: float | None = None,
        max_entries: int | None = None,
        namespace: str | None = None,
        now: float | None = None,
    ) -> EvictionPlan:
        """LRU entries to evict so the store fits ``max_size``/``min_free``, or unused for ``older_than``."""
        now = self._tables.clock() if now is None else now
        need, why = 0, []
        with self._tables.read() as t:
            physical = t.total(PHYSICAL_BYTES)
            if max_size is not None and physical > max_size:
                need = physical - max_size
                why.append(f"size {physical} > max_size {max_size}")
            if min_free is not None:
                floor = min_free if isinstance(min_free, MinFree) else parse_min_free(min_free)
                du = shutil.disk_usage(self._tables.layout.root)
                want = floor.of(du.total)
                if du.free < want:
                    need = max(need, want - du.free)
                    why.append(f"free {du.free} < min_free {want}")
            if need > 0:
                # Unreferenced blobs go with the sweep (or are a save in flight):
                # never evict live entries for bytes that are garbage already.
                garbage = sum(row.stored for _, row in t.decoded_blob_rows() if row.refs <= 0)
                if garbage:
                    need = max(0, need - garbage)
                    why.append(f"{garbage} bytes unreferenced (swept, not evicted)")
            if older_than is not None:
                why.append(f"unused for more than {older_than:g}s")
            cutoff = now - older_than if older_than is not None else None
            if need <= 0 and cutoff is None:
                return EvictionPlan(PlanKind.EVICT, [], 0, "within budget", _evictor=self)
            writes = t.writes()
            leased, _ = live_leases(t, now)
            candidates, skipped = self._candidates(t, leased, namespace, now)
            sim = _Simulation(now, self.grace, t)
            victims: list[Victim] = []
            for v in candidates:
                if max_entries is not None and len(victims) >= max_entries:
                    break
                if sim.freed >= need and not (cutoff is not None and v.last_access < cutoff):
                    break
                victims.append(v)
                sim.drop(v)
        return EvictionPlan(PlanKind.EVICT, sim.blobs, sim.freed, "; ".join(why), skipped, victims, self, writes)

    def _candidates(
        self, t: Txn, leased: set[str], namespace: str | None, now: float
    ) -> tuple[list[Victim], list[str]]:
        """Every entry eviction may take, least recently used first; and the keys it must skip.

        One pass over the tables (``Txn.entry_scan``), from the shadows where
        they hold: no JSON and no objects per entry.
        """
        candidates: list[Victim] = []
        skipped: list[str] = []
        ns = namespace.encode() if namespace is not None else None
        add, skip, grace, access_row = candidates.append, skipped.append, self.grace, ACCESS_ROW
        for k, raw, shadow, access, mks, rows in t.entry_scan():
            head = head_of(raw, shadow)
            entry = None
            try:
                key = k.decode()
                if head is not None and shadow is not None:
                    pinned, created = head[3] & PINNED, head[1]
                    if ns is not None and shadow[HEAD.size : HEAD.size + head[5]] != ns:
                        continue
                else:
                    entry = Entry.decode(k, raw)
                    pinned, created = entry.pinned, entry.created
                    if namespace is not None and entry.namespace != namespace:
                        continue
            except (CorruptRow, UnicodeDecodeError) as exc:
                log.warning("entry %r: %s", k, exc)
                continue
            if pinned or key in leased or now - created < grace:
                skip(key)
                continue
            last, hits = (
                access_row.unpack(access) if access is not None and len(access) == access_row.size else (created, 0)
            )
            add(_victim(last, key, k, raw, shadow, head, entry, hits, mks, rows))
        candidates.sort(key=attrgetter("last_access"))
        return candidates, skipped

    def plan_remove(self, keys: Iterable[str], *, now: float | None = None) -> EvictionPlan:
        """Entries asked for by name; a key without an entry is :class:`KeyNotFound`."""
        now = self._tables.clock() if now is None else now
        victims: list[Victim] = []
        skipped: list[str] = []
        with self._tables.read() as t:
            writes = t.writes()
            leased, _ = live_leases(t, now)
            sim = _Simulation(now, self.grace, t)
            for key in dict.fromkeys(keys):  # each once
                k = validate_key(key).encode()
                raw = t.entry_row(k)
                if raw is None:
                    raise KeyNotFound(key)
                if key in leased:
                    skipped.append(key)
                    continue
                shadow = t.shadow(k)
                head = head_of(raw, shadow)
                entry = None
                if head is not None:
                    created = head[1]
                else:
                    entry = Entry.decode(k, raw)
                    created = entry.created
                access = t.access(k)
                last, hits = access if access is not None else (created, 0)
                v = _victim(last, key, k, raw, shadow, head, entry, hits, *t.manifests_listed(key))
                victims.append(v)
                sim.drop(v)
        return EvictionPlan(PlanKind.REMOVE, sim.blobs, sim.freed, "removal requested", skipped, victims, self, writes)

    # -- execution --------------------------------------------------------------
    def execute(
        self, kind: PlanKind, victims: Sequence[Victim], *, expected: int | None, carried: Drops
    ) -> tuple[EvictedBatch, int | None]:
        """One batch: re-check and drop ``victims`` in one write transaction, then unlink.

        ``expected`` is the write count (``tables.WRITES``) if nobody but
        this plan wrote since it was read: then every victim's rows are as
        planned, and exact ones (``Victim.exact``) are removed without being
        read again.  Otherwise each victim is read again and removed only if
        it still qualifies (unleased; for eviction also unpinned, not used or
        recommitted since the plan), and every later batch does the same
        (``expected`` None): this batch checked only its own victims.  The
        references the removed manifests held are released in the same
        transaction, and blobs left without one (past the grace period) go.

        ``carried`` holds what the previous batch dropped that has records:
        this batch's transaction (the write lock, after that batch committed)
        lists them as obsolete, saving a transaction per batch, and leaves
        its own drops in ``carried`` for the next.  Returns the batch and the
        write count the next batch may expect.
        """
        now = self._tables.clock()
        evict = kind is PlanKind.EVICT
        files = self._files

        def fn(t: Txn) -> tuple[list[str], list[tuple[str, BlobRow]], int | None]:
            unchanged = expected is not None and t.writes() == expected
            if carried:
                try:
                    write_obsolete_list(t, files, carried, unchanged=unchanged)
                except OSError as exc:  # never fail an eviction for it (at 0 bytes free): gc sweeps orphans
                    log.warning("could not obsolete records: %s", exc)
                carried.manifests, carried.pins = [], []  # listed once, even if fn runs again
            if unchanged:  # every row exactly as the plan read it
                planned = [v for v in victims if v.exact]
                rest = [v for v in victims if not v.exact]
                leased: set[str] = set()
            else:
                planned, rest, leased = [], list(victims), live_leases(t, now)[0]
            t.remove_entries(
                [
                    Removal(v.raw_key, v.head[2], bool(v.head[3] & PINNED), v.manifests or ())
                    for v in planned
                    if v.head is not None
                ]
            )
            taken: list[Sequence[bytes]] = [v.refs for v in planned]
            done = [v.key for v in planned]
            for v in rest:
                refs = self._drop_rechecked(t, v, evict, leased, now)
                if refs is not None:
                    taken.append(refs)
                    done.append(v.key)
            t.count("evictions", len(done))
            dropped = drop_unreferenced(t, t.release_counts(Counter(chain.from_iterable(taken))), now, self.grace)
            t.count("bytes_evicted", sum(row.stored for _, row in dropped))  # in the same commit as the rows
            return done, dropped, t.writes() + 1 if unchanged else None  # this commit counts itself once

        with spending_allowed(self._tables.index.ballast):  # at 0 bytes free (docs/operations.md, "Damage and repair")
            (done, dropped, next_expected), drops = self._tables.write_noting_drops(fn)
        if drops:
            carried.manifests, carried.pins = drops.manifests, drops.pins
        unlink_dropped(self._tables, [d for d, row in dropped if not row.inline])
        return EvictedBatch(tuple(done), sum(row.stored for _, row in dropped)), next_expected

    def _drop_rechecked(self, t: Txn, v: Victim, evict: bool, leased: set[str], now: float) -> Sequence[bytes] | None:
        """Drop a victim after checking it still qualifies; None if it does not (or is gone)."""
        key, k = v.key, v.raw_key
        raw = t.entry_row(k)
        if raw is None or key in leased:
            return None
        entry = v.entry
        shadow = (v.shadow, v.head) if v.head is not None and v.shadow is not None else None
        if raw != v.row:  # changed since the plan: as it is now
            current = t.shadow(k)
            head = head_of(raw, current)
            shadow = (current, head) if head is not None and current is not None else None
            try:
                entry = to_entry(key, *shadow) if shadow is not None else Entry.decode(k, raw)
            except CorruptRow:
                entry = _entry_of(v)
            if evict and (entry.pinned or entry.ranks != _ranks(v)):
                return None  # pinned or recommitted since the plan: no longer a victim
        if evict:
            access = t.access(k)
            if access is not None and access[0] > v.last_access:
                return None  # used since the plan
        return drop_entry(t, key, entry, keep_pending_since=now - self.grace, now=now, shadow=shadow)


def _ranks(v: Victim) -> dict[int, int]:
    if v.head is not None and v.shadow is not None:
        return dict(ranks_of(v.shadow, v.head))
    assert v.entry is not None
    return v.entry.ranks


def _victim(
    last: float,
    key: str,
    k: bytes,
    raw: bytes,
    shadow: bytes | None,
    head: Head | None,
    entry: Entry | None,
    hits: int,
    mks: tuple[bytes, ...],
    rows: tuple[bytes, ...],
) -> Victim:
    """A planned victim with its manifests (keys ``mks``, ``rows``) read: references from the shadow
    when it describes exactly these rows, else decoded (every manifest, pending ones too)."""
    refs = refs_of(shadow, head, rows) if head is not None and shadow is not None else None
    if refs is not None:
        return Victim(last, key, k, raw, shadow, head, entry, hits, mks, tuple(refs))
    decoded = tuple(bytes.fromhex(d) for row in rows for d in manifest_refs(row)[0])
    return Victim(last, key, k, raw, shadow, head, entry, hits, None, decoded)


class _Simulation:
    """Which blobs dropping victims would free, without changing anything (for a plan)."""

    def __init__(self, now: float, grace: float, t: Txn) -> None:
        self._now = now
        self._grace = grace
        self._t = t
        self._left: dict[bytes, int] = {}  # references left per blob (row key)
        self._rows: dict[bytes, tuple[int, int, float, int, int] | None] = {}
        self.blobs: list[BlobRef] = []
        self.freed = 0

    def drop(self, v: Victim) -> None:
        rows_seen, left, now, grace = self._rows, self._left, self._now, self._grace
        for k in v.refs:
            if k not in rows_seen:
                raw = self._t.blob_row_raw(k)
                rows_seen[k] = BLOB_ROW.unpack(raw) if raw is not None and len(raw) == BLOB_ROW.size else None
            row = rows_seen[k]
            if row is None:
                continue
            n = left[k] = left.get(k, row[1]) - 1
            if n == 0 and now - row[2] >= grace:
                self.freed += row[4]  # what it takes on disk
                self.blobs.append(BlobRef(k.hex(), row[0]))
