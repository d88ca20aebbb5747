"""Whole-store verification (and repair with ``fix=True``).

Rehashes every blob, checks every manifest's references, every entry's ranks
and every refcount against the invariants (docs/architecture.md, "Invariants"), and
every on-disk record against the index (invariant 9, ``records.sync``), and
reports each finding with its kind, the key or digest it is about, and a
sentence: problems (invariant violations) apart from warnings (orphans and
stale leftovers of killed writers, which gc sweeps and which are not
errors).  A scan tolerates undecodable rows: they become findings, not
exceptions.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..blobs import unlink_dropped
from ..codec import Encoding
from ..errors import BlobMissing, BlobUnreadable, ChecksumMismatch, CorruptRow
from ..index.entryrows import Removal
from ..index.rows import BlobRow, Entry, Manifest, manifest_key, split_manifest_key, unpack_inline
from ..index.schema import CONTENT_BYTES, LOGICAL_BYTES, PHYSICAL_BYTES, PINNED_BYTES
from ..index.tables import Tables, Txn
from ..layout import Layout
from ..leases import in_flight
from ..names import validate_key
from ..reading import VerifiedRead, open_blob
from ..reasons import Reason
from ..records.files import RecordFiles
from ..records.rebuild import RebuildReport
from ..records.restore import BlobFile, reimport
from ..records.sync import check_records, fix_records

__all__ = ["Finding", "VerifyReport", "verify_store", "Progress"]

log = logging.getLogger(__name__)

#: ``progress(done, total)``, called while blobs are rehashed.
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing ``verify`` found: what kind, about which key or digest, and a sentence."""

    kind: Reason
    subject: str  # the cache key, the blob digest, or "" for the whole store
    detail: str
    problem: bool = True  # False: a warning (a leftover gc sweeps), not an invariant violation

    def __str__(self) -> str:
        return self.detail

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "subject": self.subject,
            "detail": self.detail,
            "severity": "problem" if self.problem else "warning",
        }


@dataclass
class VerifyReport:
    findings: list[Finding] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)
    blobs_checked: int = 0
    bytes_checked: int = 0
    manifests_checked: int = 0
    entries_checked: int = 0
    records_checked: int = 0
    repaired: bool = False

    @property
    def problems(self) -> list[str]:
        return [f.detail for f in self.findings if f.problem]

    @property
    def warnings(self) -> list[str]:
        return [f.detail for f in self.findings if not f.problem]

    @property
    def ok(self) -> bool:
        """No invariant is violated (or every violation was repaired by ``fix``)."""
        return not self.problems or self.repaired

    def add(self, kind: Reason, subject: str, detail: str, *, problem: bool = True) -> None:
        self.findings.append(Finding(kind, subject, detail, problem))

    @classmethod
    def damaged_index(cls, why: str) -> VerifyReport:
        """The report for an index that cannot be scanned safely (docs/operations.md, "Damage and repair")."""
        rep = cls()
        rep.add(
            Reason.CORRUPT_INDEX,
            "",
            f"the index is damaged ({why}); `adstore verify --fix` moves it to "
            "quarantine/ and rebuilds it from the blob files and records",
        )
        return rep

    def add_rebuild(self, why: str, rebuilt: RebuildReport) -> None:
        """Record a rebuild of a damaged index (``rebuild``): the damage, what came back, what is lost."""
        self.findings.insert(0, Finding(Reason.CORRUPT_INDEX, "", f"the index was damaged ({why})"))
        self.fixed.insert(
            0,
            f"moved the damaged index to {rebuilt.damaged_index} and created a fresh one; "
            f"re-registered {rebuilt.registered} intact blob file(s) ({rebuilt.registered_bytes} bytes); "
            f"restored {rebuilt.entries} entr(ies), {rebuilt.manifests} manifest(s), "
            f"{rebuilt.inline_blobs} inline blob(s) and {rebuilt.pinned} pin(s) from their records",
        )
        self.fixed[1:1] = [f"quarantined blob file {p} (not intact or not a regular file)" for p in rebuilt.quarantined]
        for skipped in rebuilt.skipped:
            self.findings.append(Finding(skipped.reason, "", f"record not restored: {skipped}", problem=False))
        self.findings.append(Finding(Reason.CORRUPT_INDEX, "", rebuilt.lost, problem=False))
        self.repaired = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "warnings": self.warnings,
            "findings": [f.to_dict() for f in self.findings],
            "fixed": self.fixed,
            "blobs_checked": self.blobs_checked,
            "bytes_checked": self.bytes_checked,
            "manifests_checked": self.manifests_checked,
            "entries_checked": self.entries_checked,
            "records_checked": self.records_checked,
            "repaired": self.repaired,
        }


def _check_blob(layout: Layout, digest: str, row: BlobRow, inline: bytes | None, rep: VerifyReport) -> bool:
    """Invariants 2 and 5 for one blob: its content hashes to its digest.  False: proven bad or missing.

    Files are read through the one read path (``reading``), opened without
    following a symlink (invariant 10), compressed ones decoded bounded by
    the recorded size.  A file the system would not read (out of
    descriptors, an I/O error) is a problem but not damage: it stays true,
    so ``--fix`` neither quarantines it nor drops what references it.
    """
    if row.quarantined:
        rep.add(Reason.QUARANTINED, digest, f"blob {digest} is quarantined")
        return False
    if row.inline:
        data, intact = unpack_inline(inline or b"")
        got, n = hashlib.sha256(data).hexdigest(), len(data)
        if not intact:
            got = f"{got} (inline checksum mismatch)"
    else:
        try:
            fd = open_blob(layout.blob_path(digest), digest)
        except BlobMissing as exc:  # no file, a symlink, not a regular file
            rep.add(Reason.BLOB_MISSING, digest, f"blob {digest}: {exc.detail}")
            return False
        except BlobUnreadable as exc:
            rep.add(Reason.IO_ERROR, digest, f"{exc} (not damage: left as it is)")
            return True
        read = VerifiedRead(fd, digest, encoding=_encoding(row), size=row.size, stored=row.stored)
        got = digest
        try:
            for _ in read.chunks():
                pass
        except ChecksumMismatch as exc:
            got = exc.got
        except BlobUnreadable as exc:
            rep.add(Reason.IO_ERROR, digest, f"{exc} (not damage: left as it is)")
            return True
        finally:
            os.close(fd)
        n = read.size
    rep.blobs_checked += 1
    rep.bytes_checked += n
    if got != digest or n != row.size:
        rep.add(Reason.CHECKSUM, digest, f"blob {digest}: content hashes to {got} ({n} bytes, expected {row.size})")
        return False
    return True


def _encoding(row: BlobRow) -> Encoding:
    return Encoding.ZSTD if row.compressed else Encoding.RAW


@dataclass
class _Scan:
    """Every row of the index as read in one transaction, decodable or not."""

    rows: dict[str, BlobRow] = field(default_factory=dict)
    inline: dict[str, bytes] = field(default_factory=dict)
    bad_rows: list[bytes] = field(default_factory=list)
    manifests: list[Manifest] = field(default_factory=list)
    bad_manifests: list[bytes] = field(default_factory=list)
    entries: dict[str, Entry] = field(default_factory=dict)
    bad_entries: list[bytes] = field(default_factory=list)
    strays: dict[str, list[bytes]] = field(default_factory=dict)
    totals: dict[bytes, int] = field(default_factory=dict)


def _scan(t: Txn, rep: VerifyReport) -> _Scan:
    s = _Scan()
    for k, v in t.blob_rows():
        if len(k) != 32:  # not a SHA-256: never turned into a path
            rep.add(Reason.CORRUPT_INDEX, "", f"blob row with a malformed key {k!r}")
            s.bad_rows.append(k)
            continue
        try:
            row = s.rows[k.hex()] = BlobRow.decode(v, k)
            if row.inline:
                s.inline[k.hex()] = t.inline_value(k.hex()) or b""
        except CorruptRow as exc:
            rep.add(Reason.CORRUPT_INDEX, k.hex(), str(exc))
            s.bad_rows.append(k)
    for mk, raw in t.manifest_rows():
        try:
            s.manifests.append(Manifest.decode(mk, raw))
        except (CorruptRow, UnicodeDecodeError) as exc:
            rep.add(Reason.CORRUPT_INDEX, "", str(exc))
            s.bad_manifests.append(mk)
    for k, v in t.entry_rows():
        try:
            e = s.entries[k.decode()] = Entry.decode(k, v)
        except (CorruptRow, UnicodeDecodeError) as exc:
            rep.add(Reason.CORRUPT_INDEX, "", str(exc))
            s.bad_entries.append(k)
            continue
        del e
    s.strays = t.strays()
    s.totals = {name: t.total(name) for name in (PHYSICAL_BYTES, CONTENT_BYTES, LOGICAL_BYTES, PINNED_BYTES)}
    return s


def verify_store(
    tables: Tables,
    *,
    fix: bool,
    grace_period: float,
    quarantine: Callable[[str], None],
    progress: Progress | None = None,
) -> VerifyReport:
    """Check every invariant against one snapshot of the index and the files; with ``fix``, repair them."""
    rep = VerifyReport()
    layout = tables.layout
    with tables.read() as t:
        s = _scan(t, rep)
    bad_blobs = _check_blobs(layout, s, rep, progress)
    doomed = _check_references(s, rep, bad_blobs, now=tables.clock(), grace_period=grace_period)
    drift = _check_totals(s, rep)
    _check_leftovers(layout, s, rep)
    issues = check_records(tables)  # invariant 9: the on-disk records against the index
    rep.records_checked = issues.checked
    for kind, subject, detail, problem in issues.findings():
        rep.add(kind, subject, detail, problem=problem)

    if fix and (rep.problems or any(s.strays.values()) or drift):
        touched = _repair(tables, rep, s, bad_blobs, doomed, quarantine)
        if touched:  # entries the repair dropped or cut: whole again from their records, if those are intact
            files = {
                d: BlobFile(d, r.size, _encoding(r), r.stored)
                for d, r in s.rows.items()
                if d not in bad_blobs and not r.inline and not r.quarantined
            }
            restored = reimport(tables, RecordFiles(layout), touched, files)
            if restored.entries:
                rep.fixed.append(
                    f"restored {restored.entries} entr(ies) ({restored.manifests} manifest(s)) "
                    "from their on-disk records"
                )
    if fix and not issues.empty:
        rep.fixed += fix_records(tables, check_records(tables))  # again: the repair may have dropped manifests
        rep.repaired = True
    return rep


def _check_blobs(layout: Layout, s: _Scan, rep: VerifyReport, progress: Progress | None) -> set[str]:
    """Invariants 2 and 5: every blob's content; returns the blobs proven bad or missing."""
    bad: set[str] = set()
    total = len(s.rows)
    for i, (digest, row) in enumerate(sorted(s.rows.items())):
        if progress is not None:
            progress(i, total)
        if not _check_blob(layout, digest, row, s.inline.get(digest), rep):
            bad.add(digest)
    if progress is not None:
        progress(total, total)
    return bad


def _check_references(
    s: _Scan, rep: VerifyReport, bad_blobs: set[str], *, now: float, grace_period: float
) -> list[Manifest]:
    """Invariants 3 and 6: manifests reference good blobs, refcounts count them, entries' ranks are committed.

    Returns the manifests the repair drops.
    """
    refs: Counter[str] = Counter()
    doomed: list[Manifest] = []
    for m in s.manifests:
        rep.manifests_checked += 1
        refs.update(m.digests())
        missing = [d for d in m.digests() if d not in s.rows or d in bad_blobs]
        if missing:
            rep.add(
                Reason.DANGLING_MANIFEST,
                m.key,
                f"manifest {m.key} rank {m.rank}: references missing or corrupt blob(s) {missing[0]}",
            )
            doomed.append(m)
        entry = s.entries.get(m.key)
        if m.committed and not (entry is not None and entry.ranks.get(m.rank) == m.generation):
            rep.add(
                Reason.NOT_CURRENT,
                m.key,
                f"manifest {m.key} rank {m.rank} gen {m.generation}: committed but not current",
            )
            doomed.append(m)
        if not m.committed and now - m.created > grace_period and not in_flight(m.producer, m.created, now):
            rep.add(
                Reason.STALE_MANIFEST,
                m.key,
                f"manifest {m.key} rank {m.rank}: uncommitted past the grace period (gc sweeps it)",
                problem=False,
            )
    by_key = {(m.key, m.rank, m.generation): m for m in s.manifests}
    for e in s.entries.values():
        rep.entries_checked += 1
        for r, g in e.ranks.items():
            current = by_key.get((e.key, r, g))
            if current is None or not current.committed:
                rep.add(Reason.INCOMPLETE, e.key, f"entry {e.key} rank {r}: current manifest is missing or uncommitted")
    for digest, row in s.rows.items():
        if row.refs != refs.get(digest, 0):
            rep.add(
                Reason.REFCOUNT,
                digest,
                f"blob {digest}: refcount {row.refs}, referenced by {refs.get(digest, 0)} manifest(s)",
            )
    return doomed


def _check_totals(s: _Scan, rep: VerifyReport) -> bool:
    """The kept totals against the rows, and rows without an entry (warnings); True when the totals drifted."""
    actual = {
        PHYSICAL_BYTES: sum(r.stored for r in s.rows.values()),
        CONTENT_BYTES: sum(r.size for r in s.rows.values()),
        LOGICAL_BYTES: sum(e.bytes for e in s.entries.values()),
        PINNED_BYTES: sum(e.bytes for e in s.entries.values() if e.pinned),
    }
    drift = actual != s.totals
    if drift:
        rep.add(
            Reason.TOTALS_DRIFT,
            "",
            "totals drifted: "
            + ", ".join(
                f"{name.decode().replace('_bytes', '')} {s.totals[name]} (actual {actual[name]})" for name in actual
            ),
            problem=False,
        )
    for table, what in (("access", "access"), ("entry_shadow", "shadow")):
        if s.strays[table]:
            rep.add(
                Reason.STRAY_ROWS,
                "",
                f"{len(s.strays[table])} {what} row(s) without an entry (verify --fix drops them)",
                problem=False,
            )
    return drift


def _check_leftovers(layout: Layout, s: _Scan, rep: VerifyReport) -> None:
    """Invariant 7: blob files without rows and temp files, which gc sweeps (warnings)."""
    registered = {d for d, r in s.rows.items() if not r.inline}
    if layout.blobs.exists():
        orphans = [
            f for sub in layout.blobs.iterdir() if sub.is_dir() for f in sub.iterdir() if f.name not in registered
        ]
        if orphans:
            rep.add(
                Reason.ORPHAN_FILES,
                "",
                f"{len(orphans)} blob file(s) without an index row (gc sweeps them)",
                problem=False,
            )
    temps = list(layout.tmp.iterdir()) if layout.tmp.exists() else []
    if temps:
        rep.add(
            Reason.STALE_TEMPS,
            "",
            f"{len(temps)} temp file(s) in tmp/ (gc sweeps them past the grace period)",
            problem=False,
        )


def _keys_of(raw_keys: list[bytes], *, manifests: bool) -> set[str]:
    """The cache keys of damaged rows that still name one (a key is validated before it names a file)."""
    out: set[str] = set()
    for k in raw_keys:
        try:
            out.add(validate_key(split_manifest_key(k)[0] if manifests else k.decode()))
        except (CorruptRow, ValueError):
            continue
    return out


def _repair(
    tables: Tables,
    rep: VerifyReport,
    s: _Scan,
    bad_blobs: set[str],
    doomed: list[Manifest],
    quarantine: Callable[[str], None],
) -> set[str]:
    """Repair in place; returns the keys whose entries it dropped or cut (``reimport`` restores them)."""
    for digest in sorted(bad_blobs):
        if not s.rows[digest].quarantined:
            quarantine(digest)
            rep.fixed.append(f"quarantined blob {digest}")

    touched = _keys_of(s.bad_entries, manifests=False) | _keys_of(s.bad_manifests, manifests=True)
    touched |= {m.key for m in doomed}

    def fn(t: Txn) -> tuple[list[str], list[str]]:
        fixed: list[str] = []
        dropped: list[str] = [k.hex() for k in s.bad_rows if len(k) == 32]
        t.move_epoch()  # rows may go: no lookup may trust its earlier checks
        for k in s.bad_rows:
            t.drop_blob_key(k)
            fixed.append(f"dropped undecodable blob row {k.hex()}")
        for k in s.bad_manifests:
            t.drop_manifest_row(k)
            fixed.append(f"dropped undecodable manifest {k!r}")
        t.remove_entries([Removal(k, 0, False) for k in s.bad_entries])  # totals: recounted below
        for k in s.bad_entries:
            fixed.append(f"dropped undecodable entry {k!r}")
        for m in {(m.key, m.rank, m.generation): m for m in doomed}.values():
            if t.manifest_row(manifest_key(m.key, m.rank, m.generation)) is not None:
                t.drop_manifest(m)
                fixed.append(f"dropped manifest {m.key} rank {m.rank} gen {m.generation}")
        # Recount everything from what is left.
        manifests = [Manifest.decode(mk, raw) for mk, raw in t.manifest_rows()]
        refs: Counter[str] = Counter(d for m in manifests for d in m.digests())
        current = {(m.key, m.rank): m for m in manifests if m.committed}
        all_keys = {m.key for m in manifests}
        physical = content = logical = pinned = 0
        for digest, row in list(t.decoded_blob_rows()):
            if digest in bad_blobs and refs.get(digest, 0) == 0:
                t.drop_blob_key(bytes.fromhex(digest))
                dropped.append(digest)
                continue
            if row.refs != refs.get(digest, 0):
                row.refs = refs.get(digest, 0)
                t.touch_blob(digest, row)
                fixed.append(f"recounted references of blob {digest}")
            physical += row.stored
            content += row.size
        for k, v in list(t.entry_rows()):
            e = Entry.decode(k, v)
            ranks = {r: g for r, g in e.ranks.items() if (e.key, r) in current and current[(e.key, r)].generation == g}
            new_bytes = sum(current[(e.key, r)].bytes for r in ranks)
            if not ranks and e.key not in all_keys:
                t.drop_entry(e.key, e)
                fixed.append(f"dropped entry {e.key} (nothing restorable left)")
                touched.add(e.key)
                continue
            if ranks != e.ranks or new_bytes != e.bytes:
                if ranks != e.ranks:
                    touched.add(e.key)
                e.ranks, e.bytes = ranks, new_bytes
                t.put_entry(e)
                fixed.append(f"repaired entry {e.key}")
            logical += e.bytes
            pinned += e.bytes if e.pinned else 0
        for table, keys in t.strays().items():
            for k in keys:
                t.drop_row(table, k)
        t.set_total(PHYSICAL_BYTES, physical)
        t.set_total(CONTENT_BYTES, content)
        t.set_total(LOGICAL_BYTES, logical)
        t.set_total(PINNED_BYTES, pinned)
        return fixed, dropped

    # The records of the rows dropped here stay: ``reimport`` restores from them, then ``fix_records``
    # removes what is left as orphans.
    (fixed, dropped), _records_left = tables.write_noting_drops(fn)
    rep.fixed += fixed
    unlink_dropped(tables, dropped)  # files of dropped rows that are still in blobs/
    rep.repaired = True
    log.info("verify --fix: %d repair(s)", len(rep.fixed))
    return touched
