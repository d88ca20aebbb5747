'''Where compiled engines live: the pluggable storage back ends of the engine cache.

A back end stores opaque blobs by engine hash, like Torch-TensorRT's
``BaseEngineCache``: ``save(hash, blob)`` and ``load(hash) -> blob | None``
(docs/engine-cache.md, "The engine cache").  The engine cache (the front end,
:class:`~adstore.integration.engine.cache.EngineCache`) owns the hit/miss/refit
logic; a back end only keeps blobs.  A blob is an
:class:`~adstore.integration.engine.record.EngineRecord`, verified by the
front end whatever the back end returns.

Three back ends ship here:

* :class:`StoreEngineStorage` (the default): the adstore store, namespace
  ``engine``, with the store's checksums, LRU, leases and budget. Metadata and
  package are two artifacts, so a hit copies the package straight from its
  verified blob to a file in this process's private directory (the loader
  needs a path; :mod:`~adstore.integration.placement`) without holding
  it in memory, noting who wrote the blob file it read.
* :class:`MemoryEngineStorage`: a bounded LRU dict, for tests and short jobs.
* Your own: subclass :class:`EngineStorage` and implement ``save``/``load``.
  Only whole, verified blobs need to round-trip; the record format and all the
  checks stay in adstore. For example, a directory per engine (a shared NFS
  export, a mounted bucket):

.. code-block:: python

    import os
    from pathlib import Path

    from adstore.integration.engine.storage import EngineStorage
    from adstore.store import atomic_write


    class DirectoryEngineStorage(EngineStorage):
        """One file per engine: <root>/<hash[:2]>/<hash>.engine."""

        name = "directory"

        def __init__(self, root):
            self.root = Path(root)

        def _path(self, hash):
            if len(hash) != 64 or not all(c in "0123456789abcdef" for c in hash):
                raise ValueError(f"not an engine hash: {hash!r}")   # never join junk into a path
            return self.root / hash[:2] / f"{hash}.engine"

        def save(self, hash, blob):
            path = self._path(hash)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, blob)          # unique temp, fsync, rename

        def load(self, hash):
            try:
                return self._path(hash).read_bytes()
            except FileNotFoundError:
                return None                   # absent: a plain miss

Pass it as ``compile(model, inputs, engine_cache=DirectoryEngineStorage("/mnt/engines"))``.
'''

from __future__ import annotations

import abc
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from adstore.integration.coordination.events import EventKind
from adstore.integration.engine.record import EngineRecord, check_meta
from adstore.integration.errors import (
    ConfigError,
    CorruptEngine,
    EngineCacheError,
    EngineUnavailable,
    RemoteEngineMiss,
    UntrustedEngine,
)
from adstore.integration.placement import rule
from adstore.integration.placement.dirs import private_path
from adstore.integration.placement.place import copy_code
from adstore.integration.placement.rule import Writer, blob_refusal
from adstore.integration.validity.envcheck import store_candidates
from adstore.store import REMOTE_REASONS, AdstoreError, BlobMissing, ChecksumMismatch, Reason

__all__ = ["EngineStorage", "MemoryEngineStorage", "StoreEngineStorage"]

logger = logging.getLogger(__name__)

#: Misses only the remote tier gives (a store lookup that asked it); reported with their own reason.


class EngineStorage(abc.ABC):
    """A place to keep engine blobs by hash. Implement ``save`` and ``load``.

    ``load`` returns ``None`` when the hash is absent. Anything a backend raises
    is caught by the engine cache and reported as a miss (or a failed save) with
    the error's reason; a backend never has to validate what it returns.
    """

    name = "base"

    @abc.abstractmethod
    def save(self, hash: str, blob: bytes) -> None:
        """Store ``blob`` under ``hash``, replacing what was there."""

    @abc.abstractmethod
    def load(self, hash: str) -> bytes | None:
        """The blob saved under ``hash``, or None."""

    # Optional hooks; the defaults go through save/load.
    def save_record(self, record: EngineRecord) -> None:
        self.save(record.hash, record.to_bytes())

    def load_record(self, hash: str) -> EngineRecord | None:
        """The verified record for ``hash`` (None when absent; raises EngineCacheError when unusable)."""
        blob = self.load(hash)
        if blob is None:
            return None
        return EngineRecord.from_bytes(blob, expected_hash=hash)

    def check_loadable(self, record: EngineRecord) -> None:
        """Raise UntrustedEngine if this record's package must not be loaded (it is native code).

        Called after the metadata matched the request and before the package is
        loaded. Default: everything this backend returns is trusted.
        """

    def touch(self, hash: str) -> None:
        """Mark ``hash`` as used (an in-process hit skipped ``load``); default: nothing."""

    def stored_components(self, *, exclude: str | None = None) -> Iterable[tuple[str, Mapping[str, Any]]]:
        """``(hash, record components)`` of engines held here, most recently used first; default: none.

        Read only on a miss, to name an engine built for the same request in
        another environment (``incompatible_env``); nothing listed is ever loaded.
        """
        return ()

    def record_event(self, event: EventKind, reason: Reason | None = None, *, seconds_saved: float = 0.0) -> None:
        """Count a hit/miss/bypass/save; default: nothing (the engine cache logs anyway)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MemoryEngineStorage(EngineStorage):
    """Engines in a dict of this process, least recently used dropped first."""

    name = "memory"

    def __init__(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError("max_bytes", f"must be >= 0, got {max_bytes}")
        if max_entries is not None and max_entries < 0:
            raise ConfigError("max_entries", f"must be >= 0, got {max_entries}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> MemoryEngineStorage:
        return cls(max_bytes=config.get("max_bytes"), max_entries=config.get("max_entries"))

    def save(self, hash: str, blob: bytes) -> None:
        with self._lock:
            self._blobs[hash] = bytes(blob)
            self._blobs.move_to_end(hash)
            self._evict_locked()

    def load(self, hash: str) -> bytes | None:
        with self._lock:
            blob = self._blobs.get(hash)
            if blob is not None:
                self._blobs.move_to_end(hash)
            return blob

    def touch(self, hash: str) -> None:
        with self._lock:
            if hash in self._blobs:
                self._blobs.move_to_end(hash)

    def _evict_locked(self) -> None:
        def over() -> bool:
            if self.max_entries is not None and len(self._blobs) > self.max_entries:
                return True
            return self.max_bytes is not None and self.nbytes > self.max_bytes

        while self._blobs and over():
            victim, _ = self._blobs.popitem(last=False)
            self.evictions += 1
            logger.debug("in-memory engine cache evicted %s", victim)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self._blobs.values())

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._blobs)

    def __len__(self) -> int:
        return len(self._blobs)

    def __contains__(self, hash: object) -> bool:
        return hash in self._blobs

    def __repr__(self) -> str:
        return f"MemoryEngineStorage(entries={len(self._blobs)}, max_bytes={self.max_bytes})"


class StoreEngineStorage(EngineStorage):
    """Engines in the adstore store (namespace ``engine``): checksums, LRU, budget.

    ``max_size`` (bytes or a size string like ``"2G"``) is a budget for the whole
    store that this cache enforces after each save by evicting least recently used
    *engine* entries only (the store's own ``max_size`` hard limit, the daemon and
    ``adstore gc`` apply too).

    An engine is native code, so a package is loaded only from a blob file owned by
    this user, root, or one of ``trusted_uids`` (``ADSTORE_TRUSTED_UIDS``); in a
    group-shared store another member's engine is a miss (``untrusted_engine``).

    With a remote tier (``remote=`` a URL, ``RemoteConfig`` or ``Remote``; a store
    opened with one; or ``ADSTORE_REMOTE`` through :meth:`from_env`) a local miss
    restores the engine's record and blobs from the remote and a save pushes them
    (``Store.open(remote=...)``).  Only records signed by a trusted key are
    restored; anything else is a miss with the remote's reason
    (``untrusted_remote``) and a compile, never a load.
    """

    name = "adstore"
    NAMESPACE = "engine"
    META_ARTIFACT = "engine.json"
    PACKAGE_ARTIFACT = "engine.pt2"

    def __init__(
        self,
        store: Any = None,
        *,
        root: str | Path | None = None,
        max_size: int | str | None = None,
        trusted_uids: Iterable[int] = (),
        remote: Any = None,
    ) -> None:
        from adstore.store import Store, parse_size

        if store is not None and (root is not None or remote is not None):
            raise ConfigError("store", "give either store= or root=/remote=, not both")
        self._owns_store = store is None
        self.store = store if store is not None else Store.open(root, remote=remote)
        self.max_size = None if max_size is None else parse_size(max_size, field="max_size")
        try:
            #: Owners whose package blobs may be loaded: this user, root, and the ones given.
            self.trusted_uids = rule.trusted_uids({}, extra=trusted_uids)
        except ConfigError as exc:
            raise ConfigError("trusted_uids", f"expected user ids, got {trusted_uids!r}") from exc

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> StoreEngineStorage:
        unknown = set(config) - {"root", "max_size", "trusted_uids", "remote"}
        if unknown:
            raise ConfigError(",".join(sorted(unknown)), "unknown engine cache option")
        return cls(
            root=config.get("root"),
            max_size=config.get("max_size"),
            trusted_uids=config.get("trusted_uids") or (),
            remote=config.get("remote"),
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StoreEngineStorage:
        """The store from ``ADSTORE_ROOT`` (and friends, ``ADSTORE_REMOTE*`` among them).

        ``ADSTORE_ENGINE_MAX_SIZE`` sets the budget; ``ADSTORE_TRUSTED_UIDS``
        (comma-separated) adds users whose engines may be loaded.
        """
        from adstore.store import Store

        env = os.environ if environ is None else environ
        uids = rule.trusted_uids(env)
        cache = cls(store=Store.from_env(env), max_size=env.get("ADSTORE_ENGINE_MAX_SIZE") or None, trusted_uids=uids)
        cache._owns_store = True
        return cache

    def close(self) -> None:
        if self._owns_store:
            self.store.close()

    # -- records -------------------------------------------------------------
    def save_record(self, record: EngineRecord) -> None:
        store = self.store
        meta_ref = store.put_bytes(record.meta_bytes())
        if record.payload is not None:
            pkg_ref = store.put_bytes(record.payload)
        elif record.payload_path is not None:
            pkg_ref = store.put_file(record.payload_path)
        else:
            raise EngineCacheError(f"engine record {record.hash} has no payload")
        if pkg_ref.digest != record.meta["payload"]["sha256"] or pkg_ref.size != record.payload_size:
            raise CorruptEngine(f"engine package for {record.hash} changed while being saved")
        summary = {
            "format_version": record.meta.get("format_version"),
            "kind": record.meta.get("kind"),
            "package_bytes": record.payload_size,
            "weights_included": bool(record.meta["payload"].get("weights_included", False)),
            "constants": len(record.meta.get("constants") or ()),
            "compile_seconds": record.meta.get("compile_seconds"),
        }
        store.save(
            record.hash,
            {self.META_ARTIFACT: meta_ref, self.PACKAGE_ARTIFACT: pkg_ref},
            namespace=self.NAMESPACE,
            components=record.meta.get("components") or {},
            meta=summary,
            trusted=self.trusted_uids,
        )
        store.count_event(EventKind.SAVE)
        if self.max_size is not None:
            self.enforce_budget()

    def load_record(self, hash: str) -> EngineRecord | None:
        store = self.store
        res = store.lookup(hash, count=False, trusted=self.trusted_uids)  # remote on an absence; sealed rows
        if not res.hit:
            if res.reason == Reason.ABSENT:
                return None
            if store.tier is not None and res.reason in REMOTE_REASONS:
                raise RemoteEngineMiss(hash, res.reason)
            raise EngineUnavailable(hash, res.reason)
        manifest = res.manifest
        if manifest is None or manifest.namespace != self.NAMESPACE:
            raise EngineUnavailable(hash, "not an engine entry")
        try:
            meta_raw = store.read_artifact(manifest, self.META_ARTIFACT)
            meta = check_meta(json.loads(meta_raw.decode("utf-8")), hash)
            pkg_ref = manifest.artifacts[self.PACKAGE_ARTIFACT]
        except ChecksumMismatch as exc:
            raise CorruptEngine(f"engine metadata blob is corrupt: {exc}") from exc
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptEngine(f"engine metadata is not JSON: {exc}") from exc
        except (KeyError, BlobMissing) as exc:
            raise EngineUnavailable(hash, f"artifact missing: {exc}") from exc
        if pkg_ref.digest != meta["payload"]["sha256"] or pkg_ref.size != meta["payload"]["size"]:
            raise CorruptEngine("engine package blob does not match its metadata")
        dest = private_path(".pt2")  # loaded from here: no other user can rename anything in
        try:
            writer = copy_code(store, pkg_ref, dest)  # streaming, verified; the writer of the file read
        except ChecksumMismatch as exc:
            dest.unlink(missing_ok=True)
            raise CorruptEngine(f"engine package blob is corrupt: {exc}") from exc
        except BlobMissing as exc:
            dest.unlink(missing_ok=True)
            raise EngineUnavailable(hash, f"package blob missing: {exc}") from exc
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        transferred = store.tier.take_restored(hash) if store.tier is not None else None
        return EngineRecord(
            hash=hash, meta=meta, payload_path=dest, owns_path=True, transferred=transferred, writer=writer
        )

    def check_loadable(self, record: EngineRecord) -> None:
        self.check_writer(record.hash, record.writer if isinstance(record.writer, Writer) else Writer(None))

    def check_writer(self, hash: str, writer: Writer) -> None:
        """Load native code only from blob files a trusted user wrote and no one else may write (UntrustedEngine).

        Also what the compile stage checks before it unpacks Inductor's files
        (kernels, pickled cache entries) from a ``torch_compile`` entry.

        ``writer`` is ``fstat`` of the descriptor the verified private copy was
        read from (:func:`~adstore.integration.placement.place.copy_code`):
        a user cannot create a file owned by someone else, and no path is
        looked at twice, so neither a link nor a file renamed in between
        passes for bytes it did not hold.  An inline blob is judged by the
        index that holds it: refused in a group-shared store, where its
        writer is unknown (:func:`~adstore.integration.placement.rule.blob_refusal`).
        """
        why = blob_refusal(self.store, writer, self.trusted_uids)
        if why is not None:
            raise UntrustedEngine(hash, writer.uid, f"package refused: {why}")

    # -- EngineStorage -----------------------------------------------------
    def save(self, hash: str, blob: bytes) -> None:
        self.save_record(EngineRecord.from_bytes(blob, expected_hash=hash))

    def load(self, hash: str) -> bytes | None:
        try:
            record = self.load_record(hash)
        except EngineUnavailable:
            return None
        if record is None:
            return None
        try:
            return record.to_bytes()
        finally:
            record.release()

    def stored_components(self, *, exclude: str | None = None) -> Iterable[tuple[str, Mapping[str, Any]]]:
        return store_candidates(self.store, self.NAMESPACE, exclude=exclude)

    def touch(self, hash: str) -> None:
        try:
            self.store.lookup(hash, count=False)  # a hit refreshes the entry's last access
        except AdstoreError as exc:
            logger.debug("touch %s: %s", hash, exc)

    def record_event(self, event: EventKind, reason: Reason | None = None, *, seconds_saved: float = 0.0) -> None:
        try:
            self.store.count_event(event, reason, seconds_saved=seconds_saved)
        except AdstoreError as exc:
            logger.debug("could not count %s: %s", event, exc)

    # -- budget --------------------------------------------------------------
    def plan_eviction(self, max_size: int | str | None = None) -> Any:
        """LRU engine entries to drop so the store fits ``max_size`` (a plan; nothing deleted)."""
        budget = self.max_size if max_size is None else max_size
        if budget is None:
            raise ConfigError("max_size", "no budget: pass max_size or construct with max_size=")
        return self.store.plan_eviction(max_size=budget, namespace=self.NAMESPACE)

    def enforce_budget(self, max_size: int | str | None = None) -> int:
        """Execute :meth:`plan_eviction`; returns bytes freed."""
        plan = self.plan_eviction(max_size)
        if not plan.victims:
            return 0
        evicted: list[str] = []
        freed = plan.execute(on_batch=lambda batch: evicted.extend(batch.keys))
        logger.info("engine budget: evicted %d engine(s), %d bytes (%s)", len(evicted), freed, plan.why)
        return freed

    def keys(self) -> list[str]:
        return [e.key for e in self.store.entries(namespace=self.NAMESPACE)]

    def __repr__(self) -> str:
        return f"StoreEngineStorage({str(self.store.root)!r}, max_size={self.max_size})"
