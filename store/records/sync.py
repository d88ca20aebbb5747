"""Keeping the on-disk records in step with the index (invariant 9; docs/operations.md, "Damage and repair").

The store writes a rank's record when it publishes and settles it when it
commits (:class:`RecordWriter`); ``verify`` compares every record file with
the index and ``verify --fix`` or gc repair what a crash or a hand left
behind (:func:`check_records`).  The index is the truth while it is sound:
a committed manifest without its record gets one written from the index, a
record whose manifest the index no longer has is an orphan and is named in
an obsolete list (``records/obsolete/``; the entry was removed or evicted, a
rebuild must not bring it back), a record that fails its checksum or names what it may not
goes to ``quarantine/``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..codec import Encoding
from ..errors import CorruptRow
from ..index.drops import Drops
from ..index.rows import Manifest, manifest_key, manifest_refs, split_manifest_key, unpack_inline
from ..index.tables import Tables, Txn
from ..layout import Layout
from ..names import validate_key
from ..reasons import Reason
from .files import Found, RecordFiles, RecordState, mtime_of
from .format import BadRecord, payload_of
from .obsolete import obsolete_dropped, purge_obsolete_records

__all__ = [
    "RecordWriter",
    "RecordInputs",
    "record_inputs",
    "components_changed",
    "RecordIssues",
    "check_records",
    "fix_records",
    "REPAIRED",
]

#: In a record's ``producer``: written from the index by ``verify --fix``, not by the process that saved it.
REPAIRED = "repaired_from_index"

log = logging.getLogger(__name__)


class RecordInputs(NamedTuple):
    """What a record needs from the index besides the manifest."""

    components: dict[str, Any]
    inline: dict[str, bytes]  # the bytes of its inline blobs
    stored: dict[str, tuple[Encoding, int]]  # its blobs kept as zstd frames, and their files' sizes


def record_inputs(t: Txn, manifest: Manifest) -> RecordInputs:
    """The entry's components, the manifest's inline blobs and how its file blobs are stored, as the index holds them.

    An inline blob whose bytes fail their checksum is left out: a rebuild
    then reports the record's blob as missing instead of restoring bad bytes.
    """
    try:
        components = t.components(manifest.key)
    except CorruptRow:
        components = {}
    inline: dict[str, bytes] = {}
    stored: dict[str, tuple[Encoding, int]] = {}
    for digest in manifest.digests():
        value = t.inline_value(digest)
        if value is not None:
            data, intact = unpack_inline(value)
            if intact:
                inline[digest] = data
            continue
        try:
            row = t.blob_row(digest)
        except CorruptRow:
            row = None
        if row is not None and row.compressed:
            stored[digest] = (Encoding.ZSTD, row.stored)
    return RecordInputs(components, inline, stored)


def components_changed(t: Txn, key: str, components: Mapping[str, Any] | None) -> bool:
    """Will a commit with ``components`` change the entry's (so its record must be written again)?"""
    if components is None:
        return False
    try:
        return dict(components) != t.components(key)
    except CorruptRow:
        return True


class RecordWriter:
    """The records half of ``Store.publish``, ``commit`` and ``pin`` (see :mod:`.files`)."""

    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self.files = RecordFiles(tables.layout)

    def published(self, manifest: Manifest, inputs: RecordInputs) -> None:
        """Write the pending record of a manifest the index just published (raises on failure)."""
        self.files.write_pending(
            payload_of(manifest, inputs.components, local=True, inline=inputs.inline, stored=inputs.stored)
        )

    def committed(self, key: str, rank: int, generation: int, *, rewrite: bool, drops: Drops | None) -> None:
        """After the index committed: move the pending record into place, then drop the superseded ones.

        ``rewrite`` (the commit changed the components) or no pending record
        (published by an adstore without records) writes it from the index.
        A failure here leaves the commit standing, only unrebuildable until
        ``verify --fix``: it is logged, never raised.
        """
        try:
            if rewrite or not self.files.commit(key, rank, generation):
                if rewrite or not self.files.is_committed(key, rank, generation):
                    self.write_from_index(key, rank, generation)
                    self.files.drop(key, rank, generation, committed=False)
        except OSError as exc:
            log.warning("record of %s rank %d not written (verify --fix writes it): %s", key, rank, exc)
        except CorruptRow as exc:
            log.warning("record of %s rank %d not written: %s", key, rank, exc)
        if drops:
            obsolete_dropped(self._tables, drops)

    def write_from_index(self, key: str, rank: int, generation: int, *, repair: bool = False) -> bool:
        """Write the committed record of (key, rank, generation) from the index; False if it has none.

        ``repair`` (``verify --fix``): not the saving process, so its producer
        says :data:`REPAIRED`, and a reader that must trust the entry refuses
        it (``seal``): rows anyone in the group could have rewritten are not
        sealed by whoever repairs them.
        """
        with self._tables.read() as t:
            manifest = t.manifest(key, rank, generation)
            if manifest is None or not manifest.committed:
                return False
            inputs = record_inputs(t, manifest)
        payload = payload_of(manifest, inputs.components, local=True, inline=inputs.inline, stored=inputs.stored)
        if repair:
            payload["producer"] = {**payload["producer"], REPAIRED: True}
        self.files.write_committed(payload)
        return True

    def pinned(self, key: str, pinned: bool) -> None:
        try:
            self.files.set_pinned(key, pinned)
        except OSError as exc:
            log.warning(
                "pin marker of %s not %s (verify --fix settles it): %s", key, "written" if pinned else "removed", exc
            )


# -- verify and gc ----------------------------------------------------------------
@dataclass
class RecordIssues:
    """Record files that disagree with the index, by what ``fix_records`` does about them."""

    checked: int = 0
    missing: list[tuple[str, int, int]] = field(default_factory=list)  # committed manifests without a record
    unfinished: list[Found] = field(default_factory=list)  # pending records of committed manifests
    orphans: list[Found] = field(default_factory=list)  # records and markers the index has nothing for
    corrupt: list[tuple[Found, str]] = field(default_factory=list)  # (file, why): quarantined by a fix
    pins: list[tuple[str, bool]] = field(default_factory=list)  # (key, pinned in the index) markers to settle

    def findings(self) -> list[tuple[Reason, str, str, bool]]:
        """(reason, subject, sentence, is a problem) for ``verify``'s report."""
        out: list[tuple[Reason, str, str, bool]] = []
        for key, rank, gen in self.missing:
            out.append(
                (
                    Reason.MISSING_RECORD,
                    key,
                    f"manifest {key} rank {rank} gen {gen}: committed but no "
                    "on-disk record (a rebuild would lose it; verify --fix writes it)",
                    False,
                )
            )
        for f in self.unfinished:
            out.append(
                (
                    Reason.MISSING_RECORD,
                    f.key,
                    f"record {f.key} rank {f.rank}: committed in the index, "
                    "still pending on disk (a commit was cut short; gc finishes it)",
                    False,
                )
            )
        for f, why in self.corrupt:
            out.append((Reason.CORRUPT_RECORD, f.key, f"record file {f.path}: {why}", True))
        if self.orphans:
            out.append(
                (
                    Reason.ORPHAN_RECORDS,
                    "",
                    f"{len(self.orphans)} record file(s) whose manifest or entry "
                    "the index no longer has (gc sweeps them)",
                    False,
                )
            )
        for key, pinned in self.pins:
            out.append(
                (
                    Reason.ORPHAN_RECORDS,
                    key,
                    f"entry {key} is {'' if pinned else 'not '}pinned but its pin "
                    "marker says otherwise (verify --fix settles it)",
                    False,
                )
            )
        return out

    @property
    def empty(self) -> bool:
        return not (self.missing or self.unfinished or self.orphans or self.corrupt or self.pins)


def check_records(tables: Tables, *, read: bool = True) -> RecordIssues:
    """Compare every file under ``records/`` with the index.

    ``read`` (``verify``): decode and checksum each record, and look for
    committed manifests and pins that have no file.  Without it (gc), only
    names are compared: orphans and unfinished commits, one pass over the
    manifest keys.  The files are listed before the index is read, so a
    record committed meanwhile has its manifest row in the snapshot.
    """
    files = RecordFiles(tables.layout)
    issues = RecordIssues()
    found = list(files.scan())
    with tables.read() as t:
        current: set[tuple[str, int, int]] = set()
        pinned: set[str] = set()
        if read:
            for entry, _ in t.entries():
                if not _valid_key(entry.key):  # a tampered row: verify reports it, no file is named after it
                    continue
                current.update((entry.key, r, g) for r, g in entry.ranks.items())
                if entry.pinned:
                    pinned.add(entry.key)
        else:
            for f in found:
                if f.state is RecordState.PIN:
                    if t.is_pinned(f.key.encode()):
                        pinned.add(f.key)
        rows: dict[tuple[str, int, int], bool] = {}
        for mk, raw in t.manifest_rows():
            try:
                key, rank, generation = split_manifest_key(mk)
            except (CorruptRow, UnicodeDecodeError):
                continue
            rows[(key, rank, generation)] = manifest_refs(raw)[1]
    committed_files: set[tuple[str, int, int]] = set()
    settled: list[Found] = []  # pending records of committed manifests (not corrupt)
    markers: set[str] = set()
    for f in found:
        ident = (f.key, f.rank, f.generation)
        if f.state is RecordState.UNKNOWN:
            issues.corrupt.append((f, "not a file the store writes (name, type or place)"))
            continue
        if f.state is RecordState.PIN:
            markers.add(f.key)
            if f.key not in pinned:
                issues.orphans.append(f)
            continue
        if read:
            try:
                files.read_found(f)
                issues.checked += 1
            except BadRecord as exc:
                issues.corrupt.append((f, exc.detail))
                continue
        if f.state is RecordState.COMMITTED:
            committed_files.add(ident)
            if not rows.get(ident, False):
                issues.orphans.append(f)
        elif ident not in rows:
            issues.orphans.append(f)
        elif rows[ident]:
            settled.append(f)
    issues.unfinished = settled  # the rename finishes them (over a committed copy, if one was made meanwhile)
    unfinished = {(f.key, f.rank, f.generation) for f in issues.unfinished}
    issues.missing = sorted(i for i in current if rows.get(i) and i not in committed_files and i not in unfinished)
    issues.pins = sorted((k, True) for k in pinned - markers)
    return issues


def _valid_key(key: str) -> bool:
    try:
        validate_key(key)
    except ValueError:
        return False
    return True


def fix_records(tables: Tables, issues: RecordIssues, *, grace_period: float | None = None) -> list[str]:
    """Repair what :func:`check_records` found; returns what was done.

    With ``grace_period`` (gc), orphans and unfinished commits younger than
    it are left alone (a save may be between its index transaction and its
    rename) and nothing is written or quarantined; without it (``verify
    --fix``), everything is settled.  Each removal re-checks the index under
    its write lock (``obsolete.obsolete_dropped``).
    """
    writer = RecordWriter(tables)
    files = writer.files
    done: list[str] = []
    cutoff = tables.clock() - (grace_period or 0.0)
    for f in issues.unfinished:
        if grace_period is not None and mtime_of(f) > cutoff:
            continue
        try:
            if files.commit(f.key, f.rank, f.generation):
                done.append(f"finished the commit of record {f.key} rank {f.rank}")
        except OSError as exc:
            log.warning("could not finish record %s: %s", f.path, exc)
    drops = Drops()
    for f in issues.orphans:
        if grace_period is not None and mtime_of(f) > cutoff:
            continue
        if f.state is RecordState.PIN:
            drops.pins.append(f.key.encode())
        else:
            which = 1 if f.state is RecordState.COMMITTED else 2
            drops.manifests.append((manifest_key(f.key, f.rank, f.generation), which))
    if drops:
        obsolete_dropped(tables, drops)
        done.append(f"removed {len(drops.manifests) + len(drops.pins)} orphan record file(s)")
    if grace_period is not None:
        return done  # gc deletes what the obsolete lists name next
    purge_obsolete_records(tables)  # verify --fix: the orphans just listed, and any earlier lists
    layout: Layout = tables.layout
    for f, why in issues.corrupt:
        target = layout.quarantine / f"record.{f.path.name[:200]}.{time.time_ns()}"
        try:
            layout.mkdir(layout.quarantine)
            os.replace(f.path, target)  # a symlink is moved itself, never followed
            done.append(f"quarantined record file {f.path} ({why})")
        except OSError as exc:
            log.warning("could not quarantine %s: %s", f.path, exc)
    rewrite = list(issues.missing) + [
        (f.key, f.rank, f.generation) for f, _ in issues.corrupt if f.state is RecordState.COMMITTED
    ]
    for key, rank, gen in rewrite:
        try:
            if writer.write_from_index(key, rank, gen, repair=True):
                done.append(f"wrote the record of {key} rank {rank} gen {gen} from the index")
        except (OSError, CorruptRow) as exc:
            log.warning("could not write the record of %s rank %d: %s", key, rank, exc)
    with tables.read() as t:
        for key, _ in issues.pins:
            entry = t.entry(key)
            if entry is not None:
                writer.pinned(key, entry.pinned)
                done.append(f"{'wrote' if entry.pinned else 'removed'} the pin marker of {key}")
    return done
