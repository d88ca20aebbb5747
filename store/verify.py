"""Whole-store verification (and repair with ``fix=True``).

Rehashes every blob, checks every manifest's references, every entry's ranks
and every refcount against the invariants of DESIGN.md §2, and reports
problems (invariant violations) separately from warnings (orphans and stale
leftovers of killed writers, which gc sweeps and which are not errors).
A scan tolerates undecodable rows: they become problems, not exceptions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lmdb

from .blobs import CHUNK_SIZE, Layout
from .errors import CorruptRecord
from .index import Index
from .manifests import drop_manifest_txn
from .records import BlobRow, Entry, Manifest, manifest_key, unpack_inline
from .stats import BLOB_EPOCH, LOGICAL, PHYSICAL, bump, read_int, write_int

__all__ = ["VerifyReport", "verify_store"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    blobs_checked: int = 0
    bytes_checked: int = 0
    manifests_checked: int = 0
    entries_checked: int = 0
    repaired: bool = False

    @property
    def ok(self) -> bool:
        """No invariant is violated (or every violation was repaired by ``fix``)."""
        return not self.problems or self.repaired

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "warnings": self.warnings,
            "fixed": self.fixed,
            "blobs_checked": self.blobs_checked,
            "bytes_checked": self.bytes_checked,
            "manifests_checked": self.manifests_checked,
            "entries_checked": self.entries_checked,
            "repaired": self.repaired,
        }


def _hash_file(path: os.PathLike[str]) -> tuple[str, int] | None:
    h = hashlib.sha256()
    n = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK_SIZE):
                h.update(chunk)
                n += len(chunk)
    except OSError:  # missing, a directory, unreadable: the blob is not there
        return None
    return h.hexdigest(), n


def verify_store(
    index: Index,
    layout: Layout,
    *,
    fix: bool,
    grace_period: float,
    quarantine: Callable[[str], None],
    progress: Progress | None = None,
) -> VerifyReport:
    rep = VerifyReport()
    dbs = index.db
    rows: dict[str, BlobRow] = {}
    inline: dict[str, bytes] = {}
    bad_rows: list[bytes] = []
    manifests: list[Manifest] = []
    bad_manifests: list[bytes] = []
    entries: dict[str, Entry] = {}
    bad_entries: list[bytes] = []
    with index.read() as txn:
        for k, v in txn.cursor(db=dbs["blobs"]):
            if len(k) != 32:  # not a SHA-256: never turned into a path
                rep.problems.append(f"blob row with a malformed key {bytes(k)!r}")
                bad_rows.append(bytes(k))
                continue
            try:
                row = BlobRow.decode(bytes(v), bytes(k))
                rows[bytes(k).hex()] = row
                if row.inline:
                    data = txn.get(bytes(k), db=dbs["blobdata"])
                    inline[bytes(k).hex()] = b"" if data is None else bytes(data)
            except CorruptRecord as exc:
                rep.problems.append(str(exc))
                bad_rows.append(bytes(k))
        for k, v in txn.cursor(db=dbs["manifests"]):
            try:
                manifests.append(Manifest.decode(bytes(k), bytes(v)))
            except (CorruptRecord, UnicodeDecodeError) as exc:
                rep.problems.append(str(exc))
                bad_manifests.append(bytes(k))
        for k, v in txn.cursor(db=dbs["entries"]):
            try:
                e = Entry.decode(bytes(k), bytes(v))
                entries[e.key] = e
            except CorruptRecord as exc:
                rep.problems.append(str(exc))
                bad_entries.append(bytes(k))
        stray_access = sum(1 for k in txn.cursor(db=dbs["access"]).iternext(values=False)
                           if txn.get(bytes(k), db=dbs["entries"]) is None)
        stored_physical = read_int(txn, dbs["meta"], PHYSICAL)
        stored_logical = read_int(txn, dbs["meta"], LOGICAL)

    # 1. blob content
    bad_blobs: set[str] = set()
    total = len(rows)
    for i, (digest, row) in enumerate(sorted(rows.items())):
        if progress is not None:
            progress(i, total)
        if row.quarantined:
            rep.problems.append(f"blob {digest} is quarantined")
            bad_blobs.add(digest)
            continue
        if row.inline:
            data, intact = unpack_inline(inline[digest])
            got, n = hashlib.sha256(data).hexdigest(), len(data)
            if not intact:
                got = f"{got} (inline checksum mismatch)"
        else:
            res = _hash_file(layout.blob_path(digest))
            if res is None:
                rep.problems.append(f"blob {digest}: file missing or unreadable")
                bad_blobs.add(digest)
                continue
            got, n = res
        rep.blobs_checked += 1
        rep.bytes_checked += n
        if got != digest or n != row.size:
            rep.problems.append(f"blob {digest}: content hashes to {got} ({n} bytes, expected {row.size})")
            bad_blobs.add(digest)
    if progress is not None:
        progress(total, total)

    # 2. manifests, refcounts, entries
    refs: Counter[str] = Counter()
    doomed: list[Manifest] = []
    for m in manifests:
        rep.manifests_checked += 1
        for d in m.digests():
            refs[d] += 1
        missing = [d for d in m.digests() if d not in rows or d in bad_blobs]
        if missing:
            rep.problems.append(f"manifest {m.key} rank {m.rank}: references missing or corrupt blob(s) {missing[0]}")
            doomed.append(m)
        entry = entries.get(m.key)
        current = entry is not None and entry.ranks.get(m.rank) == m.generation
        if m.committed and not current:
            rep.problems.append(f"manifest {m.key} rank {m.rank} gen {m.generation}: committed but not current")
            doomed.append(m)
        if not m.committed and time.time() - m.created > grace_period:
            rep.warnings.append(f"manifest {m.key} rank {m.rank}: uncommitted past the grace period (gc sweeps it)")
    by_key = {(m.key, m.rank, m.generation): m for m in manifests}
    for e in entries.values():
        rep.entries_checked += 1
        for r, g in e.ranks.items():
            m = by_key.get((e.key, r, g))
            if m is None or not m.committed:
                rep.problems.append(f"entry {e.key} rank {r}: current manifest is missing or uncommitted")
    for digest, row in rows.items():
        if row.refs != refs.get(digest, 0):
            rep.problems.append(f"blob {digest}: refcount {row.refs}, referenced by {refs.get(digest, 0)} manifest(s)")
    physical = sum(r.size for r in rows.values())
    logical = sum(e.bytes for e in entries.values())
    if physical != stored_physical or logical != stored_logical:
        rep.warnings.append(
            f"totals drifted: physical {stored_physical} (actual {physical}), logical {stored_logical} (actual {logical})"
        )

    if stray_access:
        rep.warnings.append(f"{stray_access} access row(s) without an entry (verify --fix drops them)")

    # 3. files without rows, leftovers
    registered = {d for d, r in rows.items() if not r.inline}
    if layout.blobs.exists():
        orphans = [f for sub in layout.blobs.iterdir() if sub.is_dir() for f in sub.iterdir() if f.name not in registered]
        if orphans:
            rep.warnings.append(f"{len(orphans)} blob file(s) without an index row (gc sweeps them)")
    temps = list(layout.tmp.iterdir()) if layout.tmp.exists() else []
    if temps:
        rep.warnings.append(f"{len(temps)} temp file(s) in tmp/ (gc sweeps them past the grace period)")

    if fix and (rep.problems or stray_access or physical != stored_physical or logical != stored_logical):
        _repair(index, layout, rep, rows, bad_blobs, bad_rows, bad_manifests, bad_entries, doomed, quarantine)
    return rep


def _repair(
    index: Index,
    layout: Layout,
    rep: VerifyReport,
    rows: dict[str, BlobRow],
    bad_blobs: set[str],
    bad_rows: list[bytes],
    bad_manifests: list[bytes],
    bad_entries: list[bytes],
    doomed: list[Manifest],
    quarantine: Callable[[str], None],
) -> None:
    for digest in sorted(bad_blobs):
        if not rows[digest].quarantined:
            quarantine(digest)
            rep.fixed.append(f"quarantined blob {digest}")
    dbs = index.db

    def fn(txn: lmdb.Transaction) -> list[str]:
        fixed: list[str] = []
        bump(txn, dbs["meta"], BLOB_EPOCH, 1)  # rows may go: no lookup may trust its earlier checks
        for k in bad_rows:
            txn.delete(k, db=dbs["blobs"])
            txn.delete(k, db=dbs["blobdata"])
            fixed.append(f"dropped undecodable blob row {k.hex()}")
        for k in bad_manifests:
            txn.delete(k, db=dbs["manifests"])
            fixed.append(f"dropped undecodable manifest {k!r}")
        for k in bad_entries:
            txn.delete(k, db=dbs["entries"])
            txn.delete(k, db=dbs["access"])
            txn.delete(k, db=dbs["components"])
            fixed.append(f"dropped undecodable entry {k!r}")
        for m in {(m.key, m.rank, m.generation): m for m in doomed}.values():
            if txn.get(manifest_key(m.key, m.rank, m.generation), db=dbs["manifests"]) is not None:
                drop_manifest_txn(txn, dbs, m)
                fixed.append(f"dropped manifest {m.key} rank {m.rank} gen {m.generation}")
        # Recount everything from what is left.
        manifests = []
        for k, v in txn.cursor(db=dbs["manifests"]):
            manifests.append(Manifest.decode(bytes(k), bytes(v)))
        refs: Counter[str] = Counter(d for m in manifests for d in m.digests())
        current = {(m.key, m.rank): m for m in manifests if m.committed}
        all_keys = {m.key for m in manifests}
        physical = 0
        for k, v in list(txn.cursor(db=dbs["blobs"])):
            if len(k) != 32:
                continue
            try:
                row = BlobRow.decode(bytes(v), bytes(k))
            except CorruptRecord:
                continue
            digest = bytes(k).hex()
            if digest in bad_blobs and refs.get(digest, 0) == 0:
                txn.delete(bytes(k), db=dbs["blobs"])
                txn.delete(bytes(k), db=dbs["blobdata"])
                continue
            if row.refs != refs.get(digest, 0):
                row.refs = refs.get(digest, 0)
                txn.put(bytes(k), row.encode(), db=dbs["blobs"])
                fixed.append(f"recounted references of blob {digest}")
            physical += row.size
        logical = 0
        for k, v in list(txn.cursor(db=dbs["entries"])):
            e = Entry.decode(bytes(k), bytes(v))
            ranks = {r: g for r, g in e.ranks.items() if (e.key, r) in current and current[(e.key, r)].generation == g}
            new_bytes = sum(current[(e.key, r)].bytes for r in ranks)
            if not ranks and e.key not in all_keys:
                txn.delete(bytes(k), db=dbs["entries"])
                txn.delete(bytes(k), db=dbs["access"])
                txn.delete(bytes(k), db=dbs["components"])
                fixed.append(f"dropped entry {e.key} (nothing restorable left)")
                continue
            if ranks != e.ranks or new_bytes != e.bytes:
                e.ranks, e.bytes = ranks, new_bytes
                txn.put(bytes(k), e.encode(), db=dbs["entries"])
                fixed.append(f"repaired entry {e.key}")
            logical += e.bytes
        for k in list(txn.cursor(db=dbs["access"]).iternext(values=False)):
            if txn.get(bytes(k), db=dbs["entries"]) is None:
                txn.delete(bytes(k), db=dbs["access"])
        write_int(txn, dbs["meta"], PHYSICAL, physical)
        write_int(txn, dbs["meta"], LOGICAL, logical)
        return fixed

    rep.fixed += index.write(fn)
    rep.repaired = True
    log.info("verify --fix: %d repair(s)", len(rep.fixed))
