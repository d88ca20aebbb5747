"""Eviction and removal of whole entries: a frozen plan first, then ``execute()``.

Eviction works on whole entries (every rank, every generation of a cache
key), least recently used first, and never on single blobs under a live
manifest (invariant 4).  Execution re-checks each victim inside the write
transaction of its batch (still unleased; for eviction also unpinned, not
used or recommitted since the plan), deletes the rows, commits, and only then
unlinks files (:func:`.aftercommit.unlink_after_commit`).  A blob that loses its
last reference is deleted only when it is older than the grace period;
otherwise the sweep takes it later (README, "Using the store").
"""

from __future__ import annotations

import enum
import logging
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any

from .aftercommit import Drops, unlink_after_commit, write_obsolete_list
from .ballast import spending_allowed
from .errors import CorruptRecord, KeyNotFound, StoreError
from .leases import live_leases
from .manifests import drop_entry
from .recordfiles import RecordFiles
from .names import validate_key
from .records import ACCESS_ROW, BLOB_ROW, BlobRef, BlobRow, Entry, manifest_refs
from .shadows import HEAD, PINNED, Head, head_of, ranks_of, refs_of, to_entry
from .tables import PHYSICAL, Tables, Txn
from .units import MinFree, parse_min_free

__all__ = ["PlanKind", "EvictedBatch", "EvictionPlan", "Evictor", "drop_unreferenced"]

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


#: A victim as planned (a tuple of atoms, which the garbage collector stops tracking: a plan
#: may hold 100k): last access, key, row key, entry row, shadow row, shadow head (None: no
#: shadow of this row), decoded entry (only without a shadow), hits, its manifests' keys
#: when its shadow describes every manifest it has (else None: execution reads them again),
#: and the blob references of all its manifests (32-byte digests, one per manifest and digest).
_Victim = tuple[float, str, bytes, bytes, "bytes | None", "Head | None", "Entry | None", int,
                "tuple[bytes, ...] | None", "tuple[bytes, ...]"]
_LAST, _KEY, _RAW_KEY, _ROW, _SHADOW, _HEAD, _ENTRY, _HITS, _MKS, _REFS = range(10)


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
    _victims: Sequence[_Victim] = field(default=(), repr=False, compare=False)
    _evictor: Evictor | None = field(default=None, repr=False, compare=False)
    #: The id of the snapshot the plan was made from (LMDB transaction ids count commits).
    _snapshot: int = field(default=-1, repr=False, compare=False)
    #: Positions of the victims that drop some blob's last planned reference (see ``execute``).
    _frees: frozenset[int] = field(default=frozenset(), repr=False, compare=False)
    _entries: list[Entry] | None = field(default=None, repr=False, compare=False)

    @property
    def count(self) -> int:
        """How many victims the plan has."""
        return len(self._victims)

    @property
    def victims(self) -> list[Entry]:
        """The victims' entries (with last access and hits as planned); treat as read-only."""
        if self._entries is None:
            object.__setattr__(self, "_entries", [_entry_of(v) for v in self._victims])
        return self._entries  # type: ignore[return-value]

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
        unchanged_at = self._snapshot + 1  # the id of the next write if nobody else commits
        carried = Drops()  # the records a batch dropped, listed as obsolete by the next one
        owing = False  # references owed by this execution's batches and not yet released
        try:
            for start in range(0, total, size):
                if should_stop is not None and should_stop():
                    break
                chunk = self._victims[start:start + size]
                # Release in the batches that free blobs (by the plan) and in the last; owe in the others.
                settle = start + size >= total or any(i in self._frees for i in range(start, start + len(chunk)))
                batch, unchanged_at, owing = self._evictor.execute(self.kind, chunk, unchanged_at=unchanged_at,
                                                                   carried=carried, settle=settle)
                freed += batch.bytes_freed
                evicted += len(batch.keys)
                if on_batch is not None and on_batch(batch):
                    break
        finally:
            if owing:  # stopped early: release what the batches so far owe
                try:
                    self._evictor.settle()
                except (StoreError, OSError) as exc:  # owed rows stay: the next release takes them
                    log.warning("owed references not released yet: %s", exc)
            if carried:  # the last batch's, or one a failed batch did not list
                unlink_after_commit(self._evictor.tables, (), carried)
        log.info("%s: %d of %d planned entr(ies), freed %d bytes", self.kind, evicted, total, freed)
        return freed

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "reason": self.why,
            "victims": [v[_KEY] for v in self._victims],
            "blobs": len(self.blobs),
            "bytes_to_free": self.bytes_to_free,
            "skipped": list(self.skipped),
        }


def _entry_of(v: _Victim) -> Entry:
    head, shadow = v[_HEAD], v[_SHADOW]
    entry = v[_ENTRY] if head is None else to_entry(v[_KEY], shadow, head)  # type: ignore[arg-type]
    assert entry is not None
    entry.last_access, entry.hits = v[_LAST], v[_HITS]
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
            physical = t.total(PHYSICAL)
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
                garbage = _unreferenced_bytes(t)
                if garbage:
                    need = max(0, need - garbage)
                    why.append(f"{garbage} bytes unreferenced (swept, not evicted)")
            if older_than is not None:
                why.append(f"unused for more than {older_than:g}s")
            cutoff = now - older_than if older_than is not None else None
            if need <= 0 and cutoff is None:
                return EvictionPlan(PlanKind.EVICT, [], 0, "within budget", _evictor=self)
            snapshot = t.raw.id()
            leased, _ = live_leases(t, now)
            candidates, skipped = self._candidates(t, leased, namespace, now)
            sim = _Simulation(now, self.grace, t)
            victims: list[_Victim] = []
            for v in candidates:
                if max_entries is not None and len(victims) >= max_entries:
                    break
                if sim.freed >= need and not (cutoff is not None and v[_LAST] < cutoff):
                    break
                victims.append(v)
                sim.drop(v)
        return EvictionPlan(PlanKind.EVICT, sim.blobs, sim.freed, "; ".join(why), skipped, victims, self, snapshot,
                            frozenset(sim.frees))

    def _candidates(self, t: Txn, leased: set[str], namespace: str | None,
                    now: float) -> tuple[list[_Victim], list[str]]:
        """Every entry eviction may take, least recently used first; and the keys it must skip.

        One pass over the tables (``Txn.entry_scan``), from the shadows where
        they hold: no JSON and no objects per entry.
        """
        candidates: list[_Victim] = []
        skipped: list[str] = []
        ns = namespace.encode() if namespace is not None else None
        add, skip, grace, access_row = candidates.append, skipped.append, self.grace, ACCESS_ROW
        for k, raw, shadow, access, mks, rows in t.entry_scan():
            head = head_of(raw, shadow)
            entry = None
            try:
                key = k.decode()
                if head is not None:
                    pinned, created = head[3] & PINNED, head[1]
                    if ns is not None and shadow[HEAD.size:HEAD.size + head[5]] != ns:  # type: ignore[index]
                        continue
                else:
                    entry = Entry.decode(k, raw)
                    pinned, created = entry.pinned, entry.created
                    if namespace is not None and entry.namespace != namespace:
                        continue
            except (CorruptRecord, UnicodeDecodeError) as exc:
                log.warning("entry %r: %s", k, exc)
                continue
            if pinned or key in leased or now - created < grace:
                skip(key)
                continue
            last, hits = access_row.unpack(access) if access is not None and len(access) == access_row.size \
                else (created, 0)
            add(_victim(last, key, k, raw, shadow, head, entry, hits, mks, rows))
        candidates.sort(key=itemgetter(_LAST))
        return candidates, skipped

    def plan_remove(self, keys: Iterable[str], *, now: float | None = None) -> EvictionPlan:
        """Entries asked for by name; a key without an entry is :class:`KeyNotFound`."""
        now = self._tables.clock() if now is None else now
        victims: list[_Victim] = []
        skipped: list[str] = []
        with self._tables.read() as t:
            snapshot = t.raw.id()
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
                entry = Entry.decode(k, raw) if head is None else None
                access = t.access(k)
                created = head[1] if head is not None else entry.created  # type: ignore[union-attr]
                last, hits = access if access is not None else (created, 0)
                v = _victim(last, key, k, raw, shadow, head, entry, hits, *t.manifests_listed(key))
                victims.append(v)
                sim.drop(v)
        return EvictionPlan(PlanKind.REMOVE, sim.blobs, sim.freed, "removal requested", skipped, victims, self,
                            snapshot, frozenset(sim.frees))

    # -- execution --------------------------------------------------------------
    def execute(self, kind: PlanKind, victims: Sequence[_Victim], *, unchanged_at: int,
                carried: Drops, settle: bool) -> tuple[EvictedBatch, int, bool]:
        """One batch: re-check and drop ``victims`` in one write transaction, then unlink.

        When its transaction's id is ``unchanged_at``, no one committed since
        the plan's snapshot (nor between this plan's previous batches, which
        only dropped their own victims), so every victim's rows are as planned
        and are dropped without being read again (LMDB transactions see
        committed snapshots; each commit that changes something takes the
        next id).  Once a batch finds a foreign commit, every later batch of
        the plan re-reads its victims: that batch checked only its own.
        A commit that changes nothing takes no id: after a batch that dropped
        no victim (all used or pinned since the plan) the next writer gets
        this batch's id again, so the next batch may only expect that id
        (expecting the one after would take another writer's commit for none).

        ``carried`` holds what the previous batch dropped that has records:
        this batch's transaction (the write lock, after that batch committed)
        lists them as obsolete, saving a transaction per batch, and leaves
        its own drops in ``carried`` for the next.

        Without ``settle`` (by the plan, no victim here drops a blob's last
        reference) and with every row as planned, the batch owes the
        references it dropped (``blobrows``) instead of rewriting their blob
        rows; a settling batch releases them together with every owed one.
        Returns the batch, the ``unchanged_at`` of the next batch (the id its
        transaction has if no one else commits; -1 after a foreign commit) and
        whether it owed.
        """
        now = self._tables.clock()
        evict = kind is PlanKind.EVICT
        files = self._files

        def fn(t: Txn) -> tuple[list[str], list[tuple[str, BlobRow]], int, bool]:
            unchanged = t.raw.id() == unchanged_at
            if carried:
                try:
                    write_obsolete_list(t, files, carried, unchanged=unchanged)
                except OSError as exc:  # never fail an eviction for it (at 0 bytes free): gc sweeps orphans
                    log.warning("could not obsolete records: %s", exc)
                carried.manifests, carried.pins = [], []  # listed once, even if fn runs again
            if unchanged:  # every row exactly as the plan read it
                planned = [v for v in victims if v[_MKS] is not None and v[_HEAD] is not None]
                rest = [v for v in victims if v[_MKS] is None or v[_HEAD] is None] if len(planned) < len(victims) else []
                leased: set[str] = set()
            else:
                planned, rest, leased = [], list(victims), live_leases(t, now)[0]
            t.forget_entries([(v[_RAW_KEY], v[_HEAD][2], v[_HEAD][3] & PINNED, v[_MKS])  # type: ignore[index]
                              for v in planned])
            taken = [v[_REFS] for v in planned]
            done = [v[_KEY] for v in planned]
            for v in rest:
                refs = self._drop_rechecked(t, v, evict, leased, now)
                if refs is not None:
                    taken.append(refs)  # type: ignore[arg-type]
                    done.append(v[_KEY])
            t.count("evictions", len(done))
            # Rows deleted: this commit takes its id.  A batch that found the index changed re-read
            # only its own victims: every later batch must re-read its own too (-1 matches no id).
            next_id = (t.raw.id() + 1 if done else t.raw.id()) if unchanged else -1
            if unchanged and not settle:
                t.owe_releases(chain.from_iterable(taken))
                return done, [], next_id, True
            counts = Counter(chain.from_iterable(taken))
            counts.update(t.take_owed_releases())
            dropped = drop_unreferenced(t, t.release_counts(counts), now, self.grace)
            t.count("bytes_evicted", sum(row.size for _, row in dropped))  # in the same commit as the rows
            return done, dropped, next_id, False

        with spending_allowed(self._tables.index.ballast):  # at 0 bytes free (README, "Damage and repair")
            (done, dropped, next_id, owed), drops = self._tables.write_noting_drops(fn)
        if drops:
            carried.manifests, carried.pins = drops.manifests, drops.pins
        unlink_after_commit(self._tables, [d for d, row in dropped if not row.inline])
        return EvictedBatch(tuple(done), sum(row.size for _, row in dropped)), next_id, owed

    def settle(self) -> int:
        """Release every owed reference (``blobrows``) and drop what that frees; returns bytes freed."""
        now = self._tables.clock()

        def fn(t: Txn) -> list[tuple[str, BlobRow]]:
            owed = t.take_owed_releases()
            return drop_unreferenced(t, t.release_counts(owed), now, self.grace) if owed else []

        with spending_allowed(self._tables.index.ballast):
            dropped = self._tables.write(fn)
        unlink_after_commit(self._tables, [d for d, row in dropped if not row.inline])
        return sum(row.size for _, row in dropped)

    def _drop_rechecked(self, t: Txn, v: _Victim, evict: bool, leased: set[str],
                        now: float) -> Sequence[bytes] | None:
        """Drop a victim after checking it still qualifies; None if it does not (or is gone)."""
        key, k = v[_KEY], v[_RAW_KEY]
        raw = t.entry_row(k)
        if raw is None or key in leased:
            return None
        entry, shadow = v[_ENTRY], (v[_SHADOW], v[_HEAD]) if v[_HEAD] is not None else None
        if raw != v[_ROW]:  # changed since the plan: as it is now
            current = t.shadow(k)
            head = head_of(raw, current)
            shadow = (current, head) if head is not None else None  # type: ignore[assignment]
            try:
                entry = to_entry(key, current, head) if head is not None else Entry.decode(k, raw)  # type: ignore[arg-type]
            except CorruptRecord:
                entry = _entry_of(v)
            if evict and (entry.pinned or entry.ranks != _ranks(v)):
                return None  # pinned or recommitted since the plan: no longer a victim
        if evict:
            access = t.access(k)
            if access is not None and access[0] > v[_LAST]:
                return None  # used since the plan
        return drop_entry(t, key, entry, keep_pending_since=now - self.grace, shadow=shadow)


def _ranks(v: _Victim) -> dict[int, int]:
    head, entry = v[_HEAD], v[_ENTRY]
    return dict(ranks_of(v[_SHADOW], head)) if head is not None else entry.ranks  # type: ignore[arg-type, union-attr]


def _victim(last: float, key: str, k: bytes, raw: bytes, shadow: bytes | None, head: Head | None,
            entry: Entry | None, hits: int, mks: tuple[bytes, ...], rows: tuple[bytes, ...]) -> _Victim:
    """A planned victim with its manifests (keys ``mks``, ``rows``) read: references from the shadow
    when it describes exactly these rows, else decoded (every manifest, pending ones too)."""
    refs = refs_of(shadow, head, rows) if head is not None else None  # type: ignore[arg-type]
    if refs is not None:
        return last, key, k, raw, shadow, head, entry, hits, mks, refs
    decoded = tuple(bytes.fromhex(d) for row in rows for d in manifest_refs(row)[0])
    return last, key, k, raw, shadow, head, entry, hits, None, decoded


class _Simulation:
    """Which blobs dropping victims would free, without changing anything (for a plan)."""

    def __init__(self, now: float, grace: float, t: Txn) -> None:
        self._now = now
        self._grace = grace
        self._t = t
        self._owed = t.owed_releases()  # references already dropped, not yet released
        self._left: dict[bytes, int] = {}  # references left per blob (row key)
        self._rows: dict[bytes, tuple[int, int, float, int] | None] = {}
        self.blobs: list[BlobRef] = []
        self.freed = 0
        self.frees: set[int] = set()  # positions of victims that drop some blob's last reference
        self._at = 0

    def drop(self, v: _Victim) -> None:
        rows_seen, left, now, grace, at = self._rows, self._left, self._now, self._grace, self._at
        self._at += 1
        for k in v[_REFS]:
            if k not in rows_seen:
                raw = self._t.blob_row_raw(k)
                rows_seen[k] = BLOB_ROW.unpack(raw) if raw is not None and len(raw) == BLOB_ROW.size else None
            row = rows_seen[k]
            if row is None:
                continue
            n = left[k] = left.get(k, row[1] - self._owed.get(k, 0)) - 1
            if n <= 0:
                self.frees.add(at)
                if n == 0 and now - row[2] >= grace:
                    self.freed += row[0]
                    self.blobs.append(BlobRef(k.hex(), row[0]))


def _unreferenced_bytes(t: Txn) -> int:
    owed = t.owed_releases()
    return sum(row.size for digest, row in t.decoded_blob_rows() if row.refs <= owed.get(bytes.fromhex(digest), 0))
