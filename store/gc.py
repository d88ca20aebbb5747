"""Eviction and orphan sweeping: plans first, then ``execute()``.

Eviction works on whole entries (every rank, every generation of a cache
key), least recently used first, and never on single blobs under a live
manifest (invariant 4).  Execution re-checks each victim inside one write
transaction (still unleased, unpinned, not used or recommitted since the
plan), deletes the rows, commits, and only then unlinks files — each unlink
under the write lock after re-checking that no writer registered the blob
again.  A blob that loses its last reference is deleted only when it is older
than the grace period; otherwise the sweep takes it later.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from .blobs import Layout
from .errors import CorruptRecord, InvalidKey
from .index import Index
from .leases import lease_is_live
from .manifests import (
    drop_entry_txn,
    drop_manifest_txn,
    get_entry,
    iter_manifests,
    manifest_digests,
    read_access,
    with_access,
)
from .records import BlobRef, BlobRow, Entry, LeaseRecord, Manifest, manifest_key, validate_key
from .stats import BLOB_EPOCH, PHYSICAL, bump, read_int
from .units import parse_min_free

__all__ = ["EvictionPlan", "SweepPlan", "Collector"]

log = logging.getLogger(__name__)

_UNLINK_BATCH = 1000


@dataclass
class EvictionPlan:
    """Entries to evict and the bytes that evicting them frees now."""

    victims: list[Entry]
    blobs: list[BlobRef]
    bytes_to_free: int
    reason: str
    skipped: list[str] = field(default_factory=list)
    _collector: Collector | None = field(default=None, repr=False)
    #: Each victim's entry row as planned: an unchanged row needs no second decode.
    _rows: dict[str, bytes] = field(default_factory=dict, repr=False)

    def execute(self) -> int:
        """Carry the plan out; returns bytes actually freed."""
        if self._collector is None or not self.victims:
            return 0
        return self._collector.execute_eviction(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "victims": [e.key for e in self.victims],
            "blobs": len(self.blobs),
            "bytes_to_free": self.bytes_to_free,
            "skipped": self.skipped,
        }


@dataclass
class SweepPlan:
    """Orphans past the grace period: files without rows, temps, stale manifests."""

    orphan_files: list[Path] = field(default_factory=list)
    stale_temps: list[Path] = field(default_factory=list)
    stale_manifests: list[Manifest] = field(default_factory=list)
    zero_ref_blobs: list[BlobRef] = field(default_factory=list)
    dead_leases: list[bytes] = field(default_factory=list)
    bytes_to_free: int = 0
    _collector: Collector | None = field(default=None, repr=False)

    @property
    def empty(self) -> bool:
        return not (self.orphan_files or self.stale_temps or self.stale_manifests
                    or self.zero_ref_blobs or self.dead_leases)

    def execute(self) -> int:
        if self._collector is None or self.empty:
            return 0
        return self._collector.execute_sweep(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "orphan_files": len(self.orphan_files),
            "stale_temps": len(self.stale_temps),
            "stale_manifests": len(self.stale_manifests),
            "zero_ref_blobs": len(self.zero_ref_blobs),
            "dead_leases": len(self.dead_leases),
            "bytes_to_free": self.bytes_to_free,
        }


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class Collector:
    """Plans and executes eviction and sweeps for one store."""

    def __init__(self, index: Index, layout: Layout, *, grace_period: float) -> None:
        self._index = index
        self._layout = layout
        self.grace = grace_period

    # -- helpers ---------------------------------------------------------
    def _leases(self, txn: lmdb.Transaction, now: float) -> tuple[set[str], list[bytes]]:
        live: set[str] = set()
        dead: list[bytes] = []
        for k, v in txn.cursor(db=self._index.db["leases"]):
            try:
                lease = LeaseRecord.decode(bytes(k), bytes(v))
            except CorruptRecord:
                dead.append(bytes(k))
                continue
            if lease_is_live(lease, now=now):
                live.add(lease.key)
            else:
                dead.append(bytes(k))
        return live, dead

    def _unreferenced_bytes(self, txn: lmdb.Transaction) -> int:
        total = 0
        for k, v in txn.cursor(db=self._index.db["blobs"]):
            if len(v) > 16 and len(k) == 32:
                try:
                    row = BlobRow.decode(bytes(v), bytes(k))
                except CorruptRecord:
                    continue
                if row.refs == 0:
                    total += row.size
        return total

    def _blob_row(self, txn: lmdb.Transaction, digest: str) -> BlobRow | None:
        k = bytes.fromhex(digest)
        raw = txn.get(k, db=self._index.db["blobs"])
        return None if raw is None else BlobRow.decode(raw, k)

    def _delete_blob_rows(self, txn: lmdb.Transaction, digests: Iterable[str], now: float) -> list[tuple[str, BlobRow]]:
        """Delete zero-ref blob rows older than the grace period; returns them."""
        deleted: list[tuple[str, BlobRow]] = []
        dbs = self._index.db
        for digest in digests:
            row = self._blob_row(txn, digest)
            if row is None or row.refs != 0 or now - row.touched < self.grace:
                continue
            k = bytes.fromhex(digest)
            txn.delete(k, db=dbs["blobs"])
            txn.delete(k, db=dbs["blobdata"])
            bump(txn, dbs["meta"], PHYSICAL, -row.size)
            deleted.append((digest, row))
        if deleted:
            bump(txn, dbs["meta"], BLOB_EPOCH, 1)
        return deleted

    def unlink_unregistered(self, digests: Sequence[str]) -> int:
        """Unlink blob files whose rows are gone, under the write lock (see module doc).

        Returns the bytes of the files unlinked.
        """
        total = 0
        for i in range(0, len(digests), _UNLINK_BATCH):
            batch = digests[i : i + _UNLINK_BATCH]

            def fn(txn: lmdb.Transaction, batch: Sequence[str] = batch) -> int:
                n = 0
                for digest in batch:
                    row = self._blob_row(txn, digest)
                    if row is not None and not row.inline and not row.quarantined:
                        continue
                    path = self._layout.blob_path(digest)
                    size = _file_size(path)
                    try:
                        os.unlink(path)
                        n += size
                    except FileNotFoundError:
                        pass
                return n

            total += self._index.write(fn)
        return total

    # -- eviction --------------------------------------------------------
    def plan_eviction(
        self,
        *,
        max_size: int | None = None,
        min_free: int | str | None = None,
        older_than: float | None = None,
        max_entries: int | None = None,
        namespace: str | None = None,
        now: float | None = None,
    ) -> EvictionPlan:
        now = time.time() if now is None else now
        need = 0
        reasons: list[str] = []
        with self._index.read() as txn:
            physical = read_int(txn, self._index.db["meta"], PHYSICAL)
            if max_size is not None and physical > max_size:
                need = physical - max_size
                reasons.append(f"size {physical} > max_size {max_size}")
            if min_free is not None:
                du = shutil.disk_usage(self._layout.root)
                want = parse_min_free(min_free).of(du.total)
                if du.free < want:
                    need = max(need, want - du.free)
                    reasons.append(f"free {du.free} < min_free {want}")
            if need > 0:
                # Unreferenced blobs go with the sweep (or are a save in flight):
                # never evict live entries for bytes that are garbage already.
                garbage = self._unreferenced_bytes(txn)
                if garbage:
                    need = max(0, need - garbage)
                    reasons.append(f"{garbage} bytes unreferenced (swept, not evicted)")
            if older_than is not None:
                reasons.append(f"unused for more than {older_than:g}s")
            cutoff = now - older_than if older_than is not None else None
            if need <= 0 and cutoff is None:
                return EvictionPlan([], [], 0, "within budget", _collector=self)
            leased, _ = self._leases(txn, now)
            candidates: list[tuple[Entry, bytes]] = []
            skipped: list[str] = []
            for k, v in txn.cursor(db=self._index.db["entries"]):
                try:
                    e = Entry.decode(bytes(k), bytes(v))
                except CorruptRecord as exc:
                    log.warning("%s", exc)
                    continue
                if namespace is not None and e.namespace != namespace:
                    continue
                if e.pinned or e.key in leased or now - e.created < self.grace:
                    skipped.append(e.key)
                    continue
                candidates.append((with_access(txn, self._index.db, e), bytes(v)))
            candidates.sort(key=lambda c: c[0].last_access)
            victims, blobs, freed = self._select(txn, [e for e, _ in candidates], need, cutoff, max_entries, now)
            rows = {e.key: raw for e, raw in candidates[:len(victims)]}
        return EvictionPlan(victims, blobs, freed, "; ".join(reasons), skipped, _collector=self, _rows=rows)

    def _select(
        self,
        txn: lmdb.Transaction,
        candidates: list[Entry],
        need: int,
        cutoff: float | None,
        max_entries: int | None,
        now: float,
    ) -> tuple[list[Entry], list[BlobRef], int]:
        victims: list[Entry] = []
        blobs: list[BlobRef] = []
        refs_left: dict[str, int] = {}
        freed = 0
        for e in candidates:
            if max_entries is not None and len(victims) >= max_entries:
                break
            expired = cutoff is not None and e.last_access < cutoff
            if not expired and freed >= need:
                break
            victims.append(e)
            freed += self._simulate_drop(txn, e.key, refs_left, blobs, now)
        return victims, blobs, freed

    def _simulate_drop(
        self, txn: lmdb.Transaction, key: str, refs_left: dict[str, int], blobs: list[BlobRef], now: float
    ) -> int:
        freed = 0
        for digests in manifest_digests(txn, self._index.db, key):
            for digest in digests:
                row = self._blob_row(txn, digest)
                if row is None:
                    continue
                left = refs_left.get(digest, row.refs) - 1
                refs_left[digest] = left
                if left == 0 and now - row.touched >= self.grace:
                    freed += row.size
                    blobs.append(BlobRef(digest, row.size))
        return freed

    def plan_remove(self, keys: Iterable[str], *, now: float | None = None) -> EvictionPlan:
        now = time.time() if now is None else now
        victims: list[Entry] = []
        blobs: list[BlobRef] = []
        skipped: list[str] = []
        refs_left: dict[str, int] = {}
        freed = 0
        with self._index.read() as txn:
            leased, _ = self._leases(txn, now)
            for key in keys:
                entry = get_entry(txn, self._index.db, validate_key(key))
                if entry is None:
                    raise InvalidKey(key, "no such entry")
                if key in leased:
                    skipped.append(key)
                    continue
                victims.append(entry)
                freed += self._simulate_drop(txn, key, refs_left, blobs, now)
        return EvictionPlan(victims, blobs, freed, "removal requested", skipped, _collector=self)

    def execute_eviction(self, plan: EvictionPlan) -> int:
        now = time.time()
        dbs = self._index.db
        explicit = plan.reason == "removal requested"

        def fn(txn: lmdb.Transaction) -> list[tuple[str, BlobRow]]:
            leased, _ = self._leases(txn, now)
            zero: list[str] = []
            evicted = 0
            for victim in plan.victims:
                entry, used = self._current(txn, victim, plan._rows.get(victim.key))
                if entry is None or entry.key in leased:
                    continue
                if not explicit and (entry.pinned or entry.ranks != victim.ranks or used):
                    continue  # used, pinned or recommitted since the plan: no longer a victim
                zero += drop_entry_txn(txn, dbs, entry.key, entry, keep_pending_since=now - self.grace)
                evicted += 1
            bump(txn, dbs["stats"], "evictions", evicted)
            return self._delete_blob_rows(txn, zero, now)

        deleted = self._index.write(fn)
        self.unlink_unregistered([d for d, row in deleted if not row.inline])
        freed = sum(row.size for _, row in deleted)
        log.info("evicted %d entr(ies), freed %d bytes", len(plan.victims), freed)
        return freed

    def _current(self, txn: lmdb.Transaction, victim: Entry, planned: bytes | None) -> tuple[Entry | None, bool]:
        """A victim's entry as it is now (None: gone), and whether it was used since the plan.

        A row byte-identical to the planned one is the planned entry (same
        ranks, same pin), so it is not decoded again: on a 100k-entry pass
        that decode was a tenth of the time.
        """
        dbs = self._index.db
        key = victim.key.encode()
        raw = txn.get(key, None, dbs["entries"])
        if raw is None:
            return None, False
        if raw == planned:
            entry = victim
        else:
            try:
                entry = Entry.decode(key, raw)
            except CorruptRecord:
                entry = victim
        access = read_access(txn, dbs, key)
        return entry, access is not None and access[0] > victim.last_access

    # -- sweep -----------------------------------------------------------
    def plan_sweep(self, *, now: float | None = None) -> SweepPlan:
        now = time.time() if now is None else now
        plan = SweepPlan(_collector=self)
        old = now - self.grace
        registered: set[str] = set()
        with self._index.read() as txn:
            for k, v in txn.cursor(db=self._index.db["blobs"]):
                if len(k) != 32:
                    continue  # malformed row: verify reports it, --fix drops it
                try:
                    row = BlobRow.decode(bytes(v), bytes(k))
                except CorruptRecord:
                    continue
                digest = bytes(k).hex()
                if not row.inline and not row.quarantined:
                    registered.add(digest)
                if row.refs == 0 and row.touched <= old:
                    plan.zero_ref_blobs.append(BlobRef(digest, row.size))
                    plan.bytes_to_free += row.size
            for k, v in txn.cursor(db=self._index.db["manifests"]):
                try:
                    m = Manifest.decode(bytes(k), bytes(v))
                except CorruptRecord:
                    continue
                if not m.committed and m.created <= old:
                    plan.stale_manifests.append(m)
            _, plan.dead_leases = self._leases(txn, now)
        for sub in sorted(self._layout.blobs.iterdir()) if self._layout.blobs.exists() else []:
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.name in registered:
                    continue
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                if st.st_mtime <= old:
                    plan.orphan_files.append(f)
                    plan.bytes_to_free += st.st_size
        for f in self._layout.tmp.iterdir() if self._layout.tmp.exists() else []:
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            if st.st_mtime <= old:
                plan.stale_temps.append(f)
                plan.bytes_to_free += st.st_size
        return plan

    def execute_sweep(self, plan: SweepPlan) -> int:
        now = time.time()
        dbs = self._index.db

        def fn(txn: lmdb.Transaction) -> list[tuple[str, BlobRow]]:
            zero = [ref.digest for ref in plan.zero_ref_blobs]
            for m in plan.stale_manifests:
                raw = txn.get(_mkey(m), db=dbs["manifests"])
                if raw is None or Manifest.decode(_mkey(m), raw).committed:
                    continue
                zero += drop_manifest_txn(txn, dbs, m)
                entry = get_entry(txn, dbs, m.key)
                if entry is not None and not entry.ranks and not any(iter_manifests(txn, dbs, m.key)):
                    drop_entry_txn(txn, dbs, m.key)
            _, dead = self._leases(txn, now)
            for lease_id in set(plan.dead_leases) & set(dead):
                txn.delete(lease_id, db=dbs["leases"])
            return self._delete_blob_rows(txn, zero, now)

        deleted = self._index.write(fn)
        freed = sum(row.size for _, row in deleted if row.inline)
        freed += self.unlink_unregistered([d for d, row in deleted if not row.inline])
        cutoff = now - self.grace
        orphans = [f.name for f in plan.orphan_files if _is_digest_name(f.name) and _older(f, cutoff)]
        freed += self.unlink_unregistered(orphans)
        for f in plan.orphan_files:
            if not _is_digest_name(f.name):
                freed += _unlink_if_old(f, cutoff)
        for f in plan.stale_temps:
            freed += _unlink_if_old(f, cutoff)
        log.info("sweep freed %d bytes", freed)
        return freed


def _mkey(m: Manifest) -> bytes:
    return manifest_key(m.key, m.rank, m.generation)


def _older(path: Path, cutoff: float) -> bool:
    try:
        return path.stat().st_mtime <= cutoff
    except FileNotFoundError:
        return False


def _is_digest_name(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _unlink_if_old(path: Path, cutoff: float) -> int:
    try:
        st = path.stat()
        if st.st_mtime > cutoff:
            return 0
        path.unlink()
        return st.st_size
    except FileNotFoundError:
        return 0
