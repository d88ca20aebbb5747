"""A seed store: a read-only store searched after the writable one, its hits copied in.

A store baked into a container image sits on a read-only mount; the
process's own store (``ADSTORE_ROOT``) is writable.  ``Store.open(root,
seed=PATH)`` (or ``ADSTORE_SEED``) opens the store at PATH read-only and,
when a lookup of the writable store finds nothing there (``absent``,
``incomplete``, ``generation_mismatch``, the misses another store can mend),
looks the key up in the seed.  A seed hit is copied into the writable store
(each blob streamed through ``Store.blob_writer``, so it is hashed and checked
against its digest before it is registered), committed under the seed's
generation, and looked up again: the caller gets an ordinary local hit, and
every read after that is the writable store's one read path.  New saves go to
the writable store; the seed is never written (docs/configuration.md,
"A seed store").

Copying, not reading in place, keeps one store behind every reader: the
integrations read blob files by path (``Store.stored_blob``) and judge the
file's owner, and the copy is theirs.  The copy is committed under this
user's record, so it would vouch for whatever the seed's index said: the
seed's rows are judged first, by the seed's own seals (``Store.lookup(key,
trusted=...)`` on the seed: each manifest must agree with its record file,
which a trusted user wrote and no one else may write, :mod:`.seal`) with the
one trusted set (:func:`.trust.trusted_uids`).  A row the seed's records do
not vouch for (a group member re-pointed a key, or rewrote its meta) is a miss
``unsealed_entry`` and nothing is copied.  A seed blob file must then pass
the file rule (:func:`.trust.file_refusal`), else a miss ``unsafe_root``; a
blob kept inline in the seed's index needs no writer: its digest is the
sealed one, and its bytes are hashed against it on the way in.
A seed searched first, before the remote tier, costs a local disk read
instead of a download.  A key the seed lacks keeps the writable store's
miss reason; a copy that another process of the same store committed first
(``torchrun``'s ranks miss the same key together) is a hit; a copy that fails
is a miss with the seed's reason
(``unsafe_root``, ``disk_full``...), nothing half-committed (unreferenced
copies are the writable store's gc's), counted (``seed.misses.<reason>``),
logged once per reason, never raised.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from .blobs import StoredBlob
from .blobwriter import BlobWriter
from .codec import Encoding
from .errors import AdstoreError, ConfigError, UnsafeRoot
from .index.rows import BlobRef, Entry, Manifest
from .lookup import LookupResult
from .maintenance.reservations import Reservation
from .reading import CHUNK_SIZE, open_blob
from .reasons import Reason
from .trust import file_refusal, trusted_uids

__all__ = ["Seed", "SeedStore", "SEED_ENV", "open_seed"]

log = logging.getLogger(__name__)

#: The environment variable naming a seed store (``Store.from_env``).
SEED_ENV = "ADSTORE_SEED"

#: Local misses a seed can mend: nothing here, ranks missing, ranks of different generations.
_MENDABLE = frozenset({Reason.ABSENT, Reason.INCOMPLETE, Reason.GENERATION_MISMATCH})


class SeedStore(Protocol):
    """What a seed copies from and into (:class:`adstore.store.Store`, which imports this module)."""

    @property
    def root(self) -> Path: ...

    def lookup(
        self,
        key: str,
        *,
        rank: int | None = ...,
        count: bool = ...,
        trusted: frozenset[int] | None = ...,
        local: bool = ...,
    ) -> LookupResult: ...

    def entry(self, key: str) -> Entry | None: ...

    def has_blob(self, ref_or_digest: BlobRef | str) -> bool: ...

    def stored_blob(self, ref_or_digest: BlobRef | str) -> StoredBlob | None: ...

    def get_bytes(self, ref_or_digest: BlobRef | str) -> bytes: ...

    def put_bytes(self, data: bytes | bytearray | memoryview) -> BlobRef: ...

    def admit(self, nbytes: int) -> Reservation: ...

    def blob_writer(self, ref: BlobRef, *, source: Encoding = ..., frame_size: int | None = ...) -> BlobWriter: ...

    def count(self, counts: Mapping[str, int]) -> None: ...

    def save(
        self,
        key: str,
        artifacts: Mapping[str, BlobRef],
        *,
        rank: int = ...,
        world_size: int = ...,
        generation: int | None = ...,
        namespace: str = ...,
        components: Mapping[str, Any] | None = ...,
        meta: Mapping[str, Any] | None = ...,
    ) -> Manifest | None: ...

    def close(self) -> None: ...


class Seed:
    """The read-only store behind a writable one (see the module docstring); ``store`` is opened read-only."""

    def __init__(self, store: SeedStore, *, trusted: frozenset[int]) -> None:
        self.store = store
        self.trusted = trusted  #: who may have written the seed's records and blob files (``trust.trusted_uids``)
        self._local = threading.local()  # this thread is copying: its own lookups stay local
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"Seed({str(self.store.root)!r})"

    @contextmanager
    def _guard(self) -> Iterator[None]:
        self._local.busy = True
        try:
            yield
        finally:
            self._local.busy = False

    def fallback(self, store: SeedStore, key: str, rank: int | None, missed: LookupResult) -> LookupResult:
        """After a local miss a seed can mend: copy the seed's committed ranks of ``key`` in and look again."""
        if getattr(self._local, "busy", False) or missed.reason not in _MENDABLE:
            return missed
        try:
            # the ranks the caller asks for, each row checked against the seed's own record (its seal)
            found = self.store.lookup(key, rank=rank, count=False, trusted=self.trusted)
        except AdstoreError as exc:
            return self._failed(store, exc.reason, exc, missed)
        if not found.hit:
            store.count({"seed.misses": 1, f"seed.misses.{found.reason}": 1})
            if found.reason is Reason.UNSEALED_ENTRY:  # the seal logged why, once
                return type(missed)(False, found.reason, entry=missed.entry)
            return missed
        try:
            with self._guard():
                self._copy(store, key, found)
        except AdstoreError as exc:
            return self._raced(store, key, rank) or self._failed(store, exc.reason, exc, missed)
        except OSError as exc:
            return self._failed(store, Reason.IO_ERROR, exc, missed)
        again = store.lookup(key, rank=rank, count=False)
        if again.hit:
            store.count({"seed.hits": 1})
        return again

    def _raced(self, store: SeedStore, key: str, rank: int | None) -> LookupResult | None:
        """The hit another process of this store committed while this one copied the same entry, else None.

        Ranks of one host (``torchrun``) miss the same key together and both
        copy it; the later commit finds the seed's generation committed
        already, and the store holds what this copy was for.
        """
        again = store.lookup(key, rank=rank, count=False, local=True)
        if not again.hit:
            return None
        log.debug("seed copy of %s: another process committed it first", key)
        return again

    def _failed(self, store: SeedStore, reason: Reason, exc: BaseException, missed: LookupResult) -> LookupResult:
        store.count({"seed.misses": 1, f"seed.misses.{reason}": 1})
        if str(reason) not in self._warned:  # logged once per reason: a seed that fails keeps failing
            self._warned.add(str(reason))
            log.warning("seed store %s: %s", self.store.root, exc)
        return type(missed)(False, reason, entry=missed.entry)

    def _copy(self, store: SeedStore, key: str, found: LookupResult) -> None:
        """Copy every blob of ``found``'s manifests the store lacks, then commit each rank under its generation."""
        entry = self.store.entry(key)  # with its key components (``adstore explain`` shows them here too)
        manifests = sorted(found.manifests.values(), key=lambda m: m.rank)
        refs = {ref.digest: ref for m in manifests for ref in m.artifacts.values()}
        for ref in refs.values():
            if not store.has_blob(ref):
                self._copy_blob(store, ref)
        for m in manifests:
            store.save(
                key,
                m.artifacts,
                rank=m.rank,
                world_size=m.world_size,
                generation=m.generation,
                namespace=m.namespace,
                components=entry.components if entry is not None else None,
                meta={**m.meta, "seed": str(self.store.root)},
            )

    def _copy_blob(self, store: SeedStore, ref: BlobRef) -> None:
        """One blob, as the seed stores it (raw or zstd frames), checked against ``ref`` by the writer."""
        where = self.store.stored_blob(ref)
        if where is None:  # inline in the seed's index: read hashed against the digest its seal vouches for
            store.put_bytes(self.store.get_bytes(ref))
            return
        with store.admit(where.stored) as reservation:
            fd = open_blob(where.path, ref.digest)  # never follows a symlink (invariant 10)
            try:
                why = file_refusal(os.fstat(fd), self.trusted)  # the very file the bytes come from
                if why is not None:
                    raise UnsafeRoot(str(self.store.root), f"blob {ref.digest[:16]} is {why}")
                source = Encoding.ZSTD if where.encoding is Encoding.ZSTD else Encoding.RAW
                frame = where.stored if source is Encoding.ZSTD else None
                with store.blob_writer(ref, source=source, frame_size=frame) as writer:
                    while chunk := os.read(fd, CHUNK_SIZE):
                        writer.write(chunk)
                    writer.commit()
            finally:
                os.close(fd)
            reservation.consume(where.stored)

    def close(self) -> None:
        self.store.close()


def open_seed(
    seed: str | os.PathLike[str] | Seed,
    *,
    root: Path,
    opener: Callable[[Path], SeedStore],
    environ: Mapping[str, str] | None = None,
) -> Seed | None:
    """The seed at ``seed`` for the store at ``root``, opened read-only by ``opener``.

    ``environ`` (``Store.from_env``'s): a seed that cannot be opened is logged and None, since a missing
    seed must not fail a process; without it (``Store.open(seed=...)``) the error is raised.  A store
    cannot be its own seed (:class:`ConfigError`).
    """
    if isinstance(seed, Seed):
        return seed
    try:
        path = Path(seed).expanduser().absolute()
        if os.path.realpath(root) == os.path.realpath(path):
            raise ConfigError(SEED_ENV, f"{path} is the store itself; a seed is another store, searched after it")
        trusted = trusted_uids(environ)
        return Seed(opener(path), trusted=trusted)
    except AdstoreError as exc:
        if environ is None:
            raise
        log.warning("seed store disabled (%s): %s", SEED_ENV, exc)
        return None
