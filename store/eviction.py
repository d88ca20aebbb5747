"""Eviction and removal of whole entries: a frozen plan first, then ``execute()``.

Eviction works on whole entries (every rank, every generation of a cache
key), least recently used first, and never on single blobs under a live
manifest (invariant 4).  Execution re-checks each victim inside the write
transaction of its batch (still unleased; for eviction also unpinned, not
used or recommitted since the plan), deletes the rows, commits, and only then
unlinks files (:meth:`Tables.unlink_after_commit`).  A blob that loses its
last reference is deleted only when it is older than the grace period;
otherwise the sweep takes it later (README, "Using the store").
"""

from __future__ import annotations

import enum
import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import CorruptRecord, KeyNotFound
from .leases import live_leases
from .manifests import drop_entry
from .records import BlobRef, BlobRow, Entry, ManifestRefs, manifest_refs, validate_key
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
    remaining: int  # victims of the plan not yet attempted


@dataclass(frozen=True)
class EvictionPlan:
    """Entries to evict or remove and the physical bytes doing so frees now.

    ``victims`` are in eviction order; lists are shared with the plan, treat
    them as read-only.
    """

    kind: PlanKind
    victims: list[Entry]
    blobs: list[BlobRef]
    bytes_to_free: int
    why: str
    skipped: list[str] = field(default_factory=list)
    _evictor: Evictor | None = field(default=None, repr=False, compare=False)
    #: Each victim's entry row as planned: an unchanged row needs no second decode.
    _rows: Mapping[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    #: Each victim's manifest rows as planned, with what they reference.
    _manifests: Mapping[bytes, tuple[bytes, ManifestRefs]] = field(default_factory=dict, repr=False, compare=False)

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
        if self._evictor is None or not self.victims:
            return 0
        size = batch_size or len(self.victims)
        freed = evicted = 0
        for start in range(0, len(self.victims), size):
            if should_stop is not None and should_stop():
                break
            chunk = self.victims[start:start + size]
            batch = self._evictor.execute(self, chunk, remaining=len(self.victims) - start - len(chunk))
            freed += batch.bytes_freed
            evicted += len(batch.keys)
            if on_batch is not None and on_batch(batch):
                break
        log.info("%s: %d of %d planned entr(ies), freed %d bytes", self.kind, evicted, len(self.victims), freed)
        return freed

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "reason": self.why,
            "victims": [e.key for e in self.victims],
            "blobs": len(self.blobs),
            "bytes_to_free": self.bytes_to_free,
            "skipped": list(self.skipped),
        }


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
        self.grace = grace_period

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
        now = time.time() if now is None else now
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
                return EvictionPlan(PlanKind.EVICT, [], [], 0, "within budget", _evictor=self)
            leased, _ = live_leases(t, now)
            candidates: list[tuple[Entry, bytes]] = []
            skipped: list[str] = []
            for e, raw in t.entries():
                if namespace is not None and e.namespace != namespace:
                    continue
                if e.pinned or e.key in leased or now - e.created < self.grace:
                    skipped.append(e.key)
                    continue
                candidates.append((t.with_access(e), raw))
            candidates.sort(key=lambda c: c[0].last_access)
            sim = _Simulation(t, now, self.grace)
            victims: list[Entry] = []
            for e, _raw in candidates:
                if max_entries is not None and len(victims) >= max_entries:
                    break
                if sim.freed >= need and not (cutoff is not None and e.last_access < cutoff):
                    break
                victims.append(e)
                sim.drop(e.key)
            rows = {e.key: raw for e, raw in candidates[:len(victims)]}
        return EvictionPlan(PlanKind.EVICT, victims, sim.blobs, sim.freed, "; ".join(why), skipped,
                            _evictor=self, _rows=rows, _manifests=sim.manifests)

    def plan_remove(self, keys: Iterable[str], *, now: float | None = None) -> EvictionPlan:
        """Entries asked for by name; a key without an entry is :class:`KeyNotFound`."""
        now = time.time() if now is None else now
        victims: list[Entry] = []
        skipped: list[str] = []
        with self._tables.read() as t:
            leased, _ = live_leases(t, now)
            sim = _Simulation(t, now, self.grace)
            for key in keys:
                entry = t.entry(validate_key(key))
                if entry is None:
                    raise KeyNotFound(key)
                if key in leased:
                    skipped.append(key)
                    continue
                victims.append(entry)
                sim.drop(key)
        return EvictionPlan(PlanKind.REMOVE, victims, sim.blobs, sim.freed, "removal requested", skipped,
                            _evictor=self, _manifests=sim.manifests)

    # -- execution --------------------------------------------------------------
    def execute(self, plan: EvictionPlan, victims: list[Entry], *, remaining: int) -> EvictedBatch:
        """One batch: re-check and drop ``victims`` in one write transaction, then unlink."""
        now = time.time()
        evict = plan.kind is PlanKind.EVICT

        def fn(t: Txn) -> tuple[list[str], list[tuple[str, BlobRow]]]:
            leased, _ = live_leases(t, now)
            refs: Counter[str] = Counter()
            done: list[str] = []
            for victim in victims:
                entry, used = _current(t, victim, plan._rows.get(victim.key))
                if entry is None or entry.key in leased:
                    continue
                if evict and (entry.pinned or entry.ranks != victim.ranks or used):
                    continue  # used, pinned or recommitted since the plan: no longer a victim
                refs.update(drop_entry(t, entry.key, entry, keep_pending_since=now - self.grace,
                                       known=plan._manifests))
                done.append(entry.key)
            t.count("evictions", len(done))
            dropped = drop_unreferenced(t, t.release(refs), now, self.grace)
            t.count("bytes_evicted", sum(row.size for _, row in dropped))  # in the same commit as the rows
            return done, dropped

        done, dropped = self._tables.write(fn)
        self._tables.unlink_after_commit([d for d, row in dropped if not row.inline])
        return EvictedBatch(tuple(done), sum(row.size for _, row in dropped), remaining)


class _Simulation:
    """Which blobs dropping entries would free, without changing anything (for a plan).

    Remembers every manifest row it read, with its references, so that the
    plan's execution does not decode an unchanged row again.
    """

    def __init__(self, t: Txn, now: float, grace: float) -> None:
        self._t = t
        self._now = now
        self._grace = grace
        self._refs_left: dict[str, int] = {}
        self._rows: dict[str, BlobRow | None] = {}
        self.blobs: list[BlobRef] = []
        self.freed = 0
        self.manifests: dict[bytes, tuple[bytes, ManifestRefs]] = {}

    def drop(self, key: str) -> None:
        for mk, raw in self._t.manifest_rows(key):
            refs = manifest_refs(raw)
            self.manifests[mk] = (raw, refs)
            for digest in refs[0]:
                if digest not in self._rows:
                    self._rows[digest] = self._t.blob_row(digest)
                row = self._rows[digest]
                if row is None:
                    continue
                left = self._refs_left.get(digest, row.refs) - 1
                self._refs_left[digest] = left
                if left == 0 and self._now - row.touched >= self._grace:
                    self.freed += row.size
                    self.blobs.append(BlobRef(digest, row.size))


def _unreferenced_bytes(t: Txn) -> int:
    total = 0
    for k, v in t.blob_rows():
        if len(k) != 32:
            continue
        try:
            row = BlobRow.decode(v, k)
        except CorruptRecord:
            continue
        if row.refs == 0:
            total += row.size
    return total


def _current(t: Txn, victim: Entry, planned: bytes | None) -> tuple[Entry | None, bool]:
    """A victim's entry as it is now (None: gone), and whether it was used since the plan.

    A row byte-identical to the planned one is the planned entry (same
    ranks, same pin), so it is not decoded again.
    """
    key = victim.key.encode()
    raw = t.entry_row(key)
    if raw is None:
        return None, False
    if raw == planned:
        entry = victim
    else:
        try:
            entry = Entry.decode(key, raw)
        except CorruptRecord:
            entry = victim
    access = t.access(key)
    return entry, access is not None and access[0] > victim.last_access
