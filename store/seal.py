"""Entries sealed to their key: the index rows of an entry that becomes code, checked against its writer's record.

In a group-shared store every member can write the index, so its rows say
nothing about who wrote them: a member can point another user's key at
another blob that user wrote, or rewrite the meta a reader acts on (a tree's
path/mode map, the compile stage's ISA answers).  Every committed manifest
also exists as an immutable, checksummed record file (invariant 9, :mod:`.records`),
created by the process that saved it and so owned by the writer's uid, mode
``0444``.  A reader that must trust an entry (``Store.lookup(key, trusted=...)``)
opens that record without following a symlink, judges ``fstat`` of the
descriptor it reads by the one trust rule (:func:`.trust.file_refusal`: a
regular file, owned by a trusted uid, writable by no untrusted user), decodes
it, and refuses the entry (``unsealed_entry``) unless the index rows say
exactly what the record says: key, rank, generation, world size, namespace,
every artifact's digest and size, and the meta.  A record being
written between the index commit and its rename is read from ``pending/``.

Decoded records are kept by the identity ``fstat`` gives (device, inode, size,
times), so a repeated lookup costs one open and one ``fstat``; a record another
member renamed over the original is another inode and is judged again.
(docs/architecture.md, "Records".)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from .blobs import StoredBlob
from .index.rows import BlobRef, Entry, Manifest, encode_json
from .lookup import LookupResult
from .reasons import Reason
from .records.files import PENDING, RecordFiles, shard_of
from .records.format import MAX_RECORD_BYTES, BadRecord, Record, decode_record
from .records.sync import REPAIRED
from .trust import file_refusal

__all__ = ["Seals", "unowned_blob", "log_once"]

log = logging.getLogger("adstore.store.store")
_logged: set[tuple[int, str]] = set()  # (pid, what): a forked child is another process and says it again

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CACHE_MAX = 4096


def unowned_blob(
    stored: Callable[[BlobRef], StoredBlob | None], refs: Mapping[str, BlobRef], trusted: frozenset[int]
) -> str | None:
    """Why an entry of ``refs`` is one its readers (trusting ``trusted``) refuse: a blob file not theirs.

    Deduplication hands a save the file another user wrote.  The layout keeps
    one file per digest, so a copy of our own would replace that user's file
    under their entries: ``Store.save(trusted=...)`` skips the save instead.
    Inline blobs (judged by their readers through the index) and blobs not
    stored (the publish refuses them) are left to those checks.
    """
    for name, ref in refs.items():
        where = stored(ref)
        if where is None:
            continue
        try:
            fd = os.open(where.path, _OPEN)
        except OSError as exc:
            return f"artifact {name}: blob {ref.digest[:12]} cannot be opened ({exc.strerror})"
        try:
            why = file_refusal(os.fstat(fd), trusted)
        finally:
            os.close(fd)
        if why is not None:
            return f"artifact {name}: blob {ref.digest[:12]} is {why}"
    return None


def log_once(what: str, message: str, *args: object) -> None:
    """A warning the first time this process meets ``what``; later ones at debug level."""
    seen = (os.getpid(), what)
    first = seen not in _logged
    _logged.add(seen)
    log.log(logging.WARNING if first else logging.DEBUG, message, *args)


class Seals:
    """Checks committed manifests against their record files (one store root)."""

    __slots__ = ("_files", "_root", "_decoded", "_count")

    def __init__(self, files: RecordFiles, count: Callable[[dict[str, int]], None]) -> None:
        self._files = files
        self._count = count
        self._root = str(files.root)
        # fstat identity -> (record, the manifest object last found to agree with it, or None)
        self._decoded: dict[tuple[int, ...], tuple[Record, Manifest | None]] = {}

    def sealed(self, key: str, result: LookupResult, trusted: frozenset[int]) -> LookupResult:
        """``result``, or a miss ``unsealed_entry`` when a manifest disagrees with its trusted record."""
        for m in result.manifests.values() or ([result.manifest] if result.manifest is not None else []):
            why = self.refusal(m, result.entry, trusted)
            if why is not None:  # counted even when the caller counts its own misses (count=False)
                self._count({"unsealed_entry": 1})
                log_once("unsealed_entry", "entry %s refused (unsealed_entry): %s", key, why)
                return LookupResult(False, Reason.UNSEALED_ENTRY, entry=result.entry)
        return result

    def vet(
        self,
        key: str,
        refs: Mapping[str, BlobRef],
        trusted: frozenset[int],
        stored: Callable[[BlobRef], StoredBlob | None],
    ) -> str | None:
        """Why a save of ``refs`` would publish what readers trusting ``trusted`` refuse (counted, logged once)."""
        why = unowned_blob(stored, refs, trusted)
        if why is not None:
            self._count({"untrusted_dedup": 1})
            log_once(
                "untrusted_dedup",
                "not saving %s (untrusted_dedup): %s; a reader trusting only uids %s would refuse it. "
                "Trust that writer with ADSTORE_TRUSTED_UIDS, or use a store of your own",
                key,
                why,
                sorted(trusted),
            )
        return why

    def refusal(self, manifest: Manifest, entry: Entry | None, trusted: frozenset[int]) -> str | None:
        """Why ``manifest`` (of ``entry``) is not what its trusted writer committed; None when it is."""
        key, rank, generation = manifest.key, manifest.rank, manifest.generation
        name = f"{key}.{int(rank)}.{int(generation)}"  # the key was validated by the lookup that found it
        for path in (f"{self._root}/{shard_of(key)}/{name}", f"{self._root}/{PENDING}/{name}"):
            try:
                fd = os.open(path, _OPEN)
            except FileNotFoundError:
                continue  # not renamed yet (committed in the index a moment ago): its pending record
            except OSError as exc:  # ELOOP: a symlink, never followed
                return f"its record {path} cannot be opened ({exc.strerror})"
            try:
                ident, record, agreed = self._read(fd, path, trusted)
            except BadRecord as exc:
                return f"its record {path}: {exc.detail}"
            finally:
                os.close(fd)
            if agreed is manifest:  # the same decoded row found to agree before (decoded rows are never mutated)
                return _entry_disagreement(record, entry)
            why = _disagreement(record, manifest, entry)
            if why is None:
                self._decoded[ident] = (record, manifest)
            return why
        return f"it has no record of rank {rank} generation {generation} (written by the saving process)"

    def _read(self, fd: int, path: str, trusted: frozenset[int]) -> tuple[tuple[int, ...], Record, Manifest | None]:
        st = os.fstat(fd)
        why = file_refusal(st, trusted)
        if why is not None:
            raise BadRecord(path, why)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_uid, st.st_mode)
        known = self._decoded.get(ident)
        if known is not None:
            return ident, *known
        if st.st_size > MAX_RECORD_BYTES:
            raise BadRecord(path, f"{st.st_size} bytes, more than any record")
        chunks = []
        try:
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        except OSError as exc:
            raise BadRecord(path, f"cannot be read ({exc.strerror})") from None
        record = decode_record(b"".join(chunks), path)
        if len(self._decoded) >= _CACHE_MAX:
            self._decoded.clear()
        self._decoded[ident] = (record, None)
        return ident, record, None


def _disagreement(record: Record, m: Manifest, entry: Entry | None) -> str | None:
    """The first field in which the index rows differ from the record; None when they agree."""
    if record.producer.get(REPAIRED):
        return "its record was written from the index by verify --fix, not by the process that saved it"
    if (record.key, record.rank, record.generation) != (m.key, m.rank, m.generation):
        return f"its record holds {record.key} rank {record.rank} generation {record.generation}"
    if record.world_size != m.world_size:
        return f"its record says world size {record.world_size}, the index {m.world_size}"
    if record.namespace != m.namespace:
        return f"its record says namespace {record.namespace}, the index {m.namespace}"
    if record.artifacts != m.artifacts:
        changed = sorted({n for n, _ in set(record.artifacts.items()) ^ set(m.artifacts.items())})
        return f"the index's artifacts differ from its record's ({', '.join(changed)[:200]})"
    if encode_json(record.meta) != encode_json(m.meta):
        return "the index's meta differs from its record's"
    return _entry_disagreement(record, entry)


def _entry_disagreement(record: Record, entry: Entry | None) -> str | None:
    """The entry row's part: its world size and namespace are the record's."""
    if entry is not None and (entry.world_size, entry.namespace) != (record.world_size, record.namespace):
        return f"its entry says world size {entry.world_size}, namespace {entry.namespace}; its record does not"
    return None
