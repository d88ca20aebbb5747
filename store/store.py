"""The store facade: blobs, manifests, entries, leases, stats, gc, verify.

One ``Store`` per process and root is the intended use; it is safe to use
from threads, after ``fork`` (the index reopens), and from many processes at
once (LMDB serialises writers; blob files are published atomically).

Access bookkeeping is deliberately lazy: a hit refreshes the entry's last
access and bumps counters in memory, and those are written at most once per
``flush_interval`` by a background thread (and at ``close``/exit).  A lookup
therefore costs one short read transaction and never waits for a disk write,
and LRU order is exact to within that interval.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from .blobs import Blobs, Layout
from .errors import CorruptRecord, InvalidKey, OverBudget, StoreError
from .fsutil import check_local_filesystem, check_root_permissions
from .gc import Collector, EvictionPlan, SweepPlan
from .index import Index
from .leases import new_lease_record
from .manifests import (
    LookupMemo,
    LookupResult,
    commit_txn,
    drop_entry_txn,
    drop_manifest_txn,
    get_components,
    get_entry,
    iter_manifests,
    lookup_txn,
    publish_txn,
    put_access,
    read_access,
    with_access,
)
from .records import (
    BlobRef,
    Entry,
    LeaseRecord,
    Manifest,
    manifest_key,
    validate_artifact_name,
    validate_key,
    validate_namespace,
)
from .stats import LOGICAL, PHYSICAL, StoreStats, bump, event_counters, read_counters, read_int
from .units import parse_duration, parse_size
from .verify import Progress, VerifyReport, verify_store

__all__ = ["Store", "default_root", "DEFAULT_GRACE_PERIOD", "DEFAULT_INLINE_THRESHOLD"]

log = logging.getLogger(__name__)

DEFAULT_GRACE_PERIOD = 600.0
DEFAULT_INLINE_THRESHOLD = 64 << 10
DEFAULT_MAP_SIZE = 1 << 30
_INLINE_EVICTION_BATCH = 64

_OPEN_STORES: weakref.WeakSet[Store] = weakref.WeakSet()


def default_root(environ: Mapping[str, str] | None = None) -> Path:
    """``$ADSTORE_ROOT``, else ``${XDG_CACHE_HOME:-~/.cache}/adstore``."""
    env = os.environ if environ is None else environ
    if env.get("ADSTORE_ROOT"):
        return Path(env["ADSTORE_ROOT"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "adstore"


def _flush_open_stores() -> None:
    for store in list(_OPEN_STORES):
        try:
            store.flush()
        except Exception:  # exit path: never turn a clean exit into a traceback
            log.debug("flush at exit failed", exc_info=True)


def _forget_parent_bookkeeping() -> None:
    # A forked child inherits the parent's unflushed counters; the parent
    # flushes those itself, so the child must not count them again.
    for store in list(_OPEN_STORES):
        store._pending_counters = Counter()
        store._pending_access = {}
        store._lock = threading.Lock()
        store._flusher_started = False  # threads do not survive fork


atexit.register(_flush_open_stores)
os.register_at_fork(after_in_child=_forget_parent_bookkeeping)


class Store:
    """A content-addressed artifact store rooted at one local directory."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        max_size: int | None = None,
        map_size: int = DEFAULT_MAP_SIZE,
        flush_interval: float = 1.0,
        check_permissions: bool = True,
    ) -> None:
        self.root = Path(root).expanduser().absolute()
        self.layout = Layout(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fstype = check_local_filesystem(self.root)
        if check_permissions:  # before anything is created inside the root
            for warning in check_root_permissions(self.root):
                log.warning("%s", warning)
        self.layout.create()
        self.grace_period = float(grace_period)
        self.inline_threshold = int(inline_threshold)
        self.max_size = max_size
        self.flush_interval = flush_interval
        self._index = Index.acquire(self.layout.index, map_size=map_size,
                                    group_shared=self.layout.group_shared)
        self._lock = threading.Lock()
        self._pending_counters: Counter[str] = Counter()
        self._pending_access: dict[str, tuple[float, int]] = {}
        self._lookups = LookupMemo()
        self._flusher_started = False
        self._closed = threading.Event()
        self._blobs = Blobs(
            self._index,
            self.layout,
            inline_threshold=self.inline_threshold,
            grace_period=self.grace_period,
            reserve=self._reserve,
            on_dedup=self._count_dedup,
        )
        self._gc = Collector(self._index, self.layout, grace_period=self.grace_period)
        _OPEN_STORES.add(self)

    @property
    def _dbs(self) -> dict[str, object]:
        # Looked up on every use: the handles change when the index reopens after fork.
        return self._index.db

    # -- construction ----------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike[str] | None = None, **settings: Any) -> Store:
        """Open (creating if needed) the store at ``root`` or the default root."""
        return cls(default_root() if root is None else root, **settings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Store:
        """Open the store named by ``ADSTORE_ROOT``, ``ADSTORE_MAX_SIZE``, ``ADSTORE_GRACE_PERIOD``."""
        env = os.environ if environ is None else environ
        settings: dict[str, Any] = {}
        if env.get("ADSTORE_MAX_SIZE"):
            settings["max_size"] = parse_size(env["ADSTORE_MAX_SIZE"], field="ADSTORE_MAX_SIZE")
        if env.get("ADSTORE_GRACE_PERIOD"):
            settings["grace_period"] = parse_duration(env["ADSTORE_GRACE_PERIOD"], field="ADSTORE_GRACE_PERIOD")
        settings.update(overrides)
        return cls(default_root(env), **settings)

    def close(self) -> None:
        if self not in _OPEN_STORES:
            return
        self._closed.set()
        self.flush()
        _OPEN_STORES.discard(self)
        self._index.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # -- blobs -----------------------------------------------------------
    def put_bytes(self, data: bytes | bytearray | memoryview) -> BlobRef:
        return self._blobs.put_bytes(data)

    def put_file(self, path: str | os.PathLike[str]) -> BlobRef:
        return self._blobs.put_file(path)

    def put_stream(self, chunks: Iterable[bytes]) -> BlobRef:
        return self._blobs.put_stream(chunks)

    def get_bytes(self, ref_or_digest: BlobRef | str) -> bytes:
        try:
            return self._blobs.get_bytes(ref_or_digest)
        except StoreError:
            self._lookups.clear()  # a read failed: re-check every entry in full from now on
            raise

    def copy_blob_to(self, ref_or_digest: BlobRef | str, dest: str | os.PathLike[str]) -> Path:
        try:
            return self._blobs.copy_to(ref_or_digest, dest)
        except StoreError:
            self._lookups.clear()
            raise

    def has_blob(self, ref_or_digest: BlobRef | str) -> bool:
        return self._blobs.has(ref_or_digest)

    def blob_path(self, ref_or_digest: BlobRef | str) -> Path | None:
        return self._blobs.path(ref_or_digest)

    def quarantine(self, digest: str) -> None:
        self._blobs.quarantine(digest)

    def _count_dedup(self, size: int) -> None:
        with self._lock:
            self._pending_counters["bytes_deduplicated"] += size
        self._maybe_flush()

    def _reserve(self, nbytes: int) -> None:
        """Keep a store without a daemon bounded: inline eviction at the hard limit."""
        if self.max_size is None:
            return
        if self.size() + nbytes <= self.max_size:
            return
        target = self.max_size - nbytes
        if target >= 0:
            plan = self._gc.plan_eviction(max_size=target, max_entries=_INLINE_EVICTION_BATCH)
            if plan.victims:
                log.info("over the hard limit: evicting %d entr(ies) inline", len(plan.victims))
                plan.execute()
        if self.size() + nbytes > self.max_size:
            sweep = self._gc.plan_sweep()  # unreferenced blobs past the grace period
            if not sweep.empty:
                sweep.execute()
        size = self.size()
        if size + nbytes > self.max_size:
            raise OverBudget(nbytes, self.max_size, size)

    # -- manifests -------------------------------------------------------
    @staticmethod
    def new_generation() -> int:
        """A fresh 63-bit generation id (rank 0 draws it; the others receive it)."""
        return secrets.randbits(62) + 1

    def publish(
        self,
        key: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        generation: int,
        artifacts: Mapping[str, BlobRef],
        namespace: str = "default",
        components: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Record this rank's manifest, uncommitted; blobs must be stored already."""
        validate_key(key)
        validate_namespace(namespace)
        if not isinstance(world_size, int) or world_size < 1:
            raise InvalidKey(world_size, "world_size must be a positive integer")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise InvalidKey(rank, f"rank must be within 0..{world_size - 1}")
        if not isinstance(generation, int) or not 0 < generation < 1 << 63:
            raise InvalidKey(generation, "generation must be a positive 63-bit integer")
        for name, ref in artifacts.items():
            validate_artifact_name(name)
            if not isinstance(ref, BlobRef):
                raise InvalidKey(ref, f"artifact {name!r} must be a BlobRef")
        return self._index.write(
            lambda txn: publish_txn(
                txn,
                self._dbs,
                key=key,
                rank=rank,
                world_size=world_size,
                generation=generation,
                artifacts=artifacts,
                namespace=namespace,
                components=components or {},
                meta=meta or {},
                file_ok=self._blobs.file_ok,
            )
        )

    def commit(self, key: str, *, rank: int = 0, generation: int,
               components: Mapping[str, Any] | None = None) -> Manifest:
        """Make a published manifest restorable; releases the rank's older generation."""
        validate_key(key)
        manifest, _zero = self._index.write(
            lambda txn: commit_txn(txn, self._dbs, key=key, rank=rank, generation=generation, components=components)
        )
        return manifest

    def abort(self, key: str, *, rank: int = 0, generation: int) -> bool:
        """Drop an uncommitted manifest (a failed save); returns whether one was dropped."""
        validate_key(key)
        mk = manifest_key(key, rank, generation)

        def fn(txn: lmdb.Transaction) -> bool:
            raw = txn.get(mk, db=self._dbs["manifests"])
            if raw is None:
                return False
            m = Manifest.decode(mk, raw)
            if m.committed:
                return False
            drop_manifest_txn(txn, self._dbs, m)
            entry = get_entry(txn, self._dbs, key)
            if entry is not None and not entry.ranks and not any(iter_manifests(txn, self._dbs, key)):
                drop_entry_txn(txn, self._dbs, key)
            return True

        return self._index.write(fn)

    def lookup(self, key: str, *, rank: int | None = None, record: bool = True) -> LookupResult:
        """A hit only when invariants 5-6 hold; else a miss with a named reason."""
        validate_key(key)
        txn = self._index.begin_read()
        try:
            result = lookup_txn(txn, self._dbs, key, rank, self._blobs.file_ok, self._lookups)
        except CorruptRecord as exc:
            log.warning("lookup of %s: %s", key, exc)
            result = LookupResult(False, "corrupt_index")
        finally:
            self._index.end_read(txn)
        with self._lock:
            pending = self._pending_counters
            if result.hit:
                hits = self._pending_access.get(key, (0.0, 0))[1]
                self._pending_access[key] = (time.time(), hits + 1)
                if record:
                    pending["hits"] += 1
            elif record:
                pending["misses"] += 1
                pending[f"misses.{result.reason}"] += 1
        self._maybe_flush()
        return result

    def read_artifact(self, manifest: Manifest, name: str) -> bytes:
        """Verified bytes of one artifact of a manifest."""
        try:
            ref = manifest.artifacts[name]
        except KeyError:
            raise InvalidKey(name, f"manifest {manifest.key} rank {manifest.rank} has no such artifact") from None
        return self.get_bytes(ref)

    def entry(self, key: str) -> Entry | None:
        """The entry of ``key`` with its key components, or None."""
        validate_key(key)
        with self._index.read() as txn:
            entry = get_entry(txn, self._dbs, key)
            if entry is not None:
                entry.components = get_components(txn, self._dbs, key)
            return entry

    def entries(self, namespace: str | None = None) -> Iterator[Entry]:
        """Every entry, without components (undecodable rows are skipped with a warning)."""
        out: list[Entry] = []
        with self._index.read() as txn:
            for k, v in txn.cursor(db=self._dbs["entries"]):
                try:
                    e = Entry.decode(bytes(k), bytes(v))
                except CorruptRecord as exc:
                    log.warning("%s", exc)
                    continue
                if namespace is None or e.namespace == namespace:
                    out.append(with_access(txn, self._dbs, e))
        return iter(out)

    def resolve_key(self, prefix: str) -> str:
        """The one entry key starting with ``prefix`` (like a short git hash)."""
        with self._index.read() as txn:
            if txn.get(prefix.encode(), db=self._dbs["entries"]) is not None:
                return prefix
            cur = txn.cursor(db=self._dbs["entries"])
            matches: list[str] = []
            if cur.set_range(prefix.encode()):
                for k in cur.iternext(keys=True, values=False):
                    if not bytes(k).startswith(prefix.encode()) or len(matches) > 1:
                        break
                    matches.append(bytes(k).decode())
        if not matches:
            raise InvalidKey(prefix, "no entry has this key or key prefix")
        if len(matches) > 1:
            raise InvalidKey(prefix, f"ambiguous key prefix ({matches[0]}, {matches[1]}, …)")
        return matches[0]

    def manifests(self, key: str) -> list[Manifest]:
        validate_key(key)
        with self._index.read() as txn:
            return list(iter_manifests(txn, self._dbs, key))

    def _set_pinned(self, key: str, pinned: bool) -> None:
        validate_key(key)

        def fn(txn: lmdb.Transaction) -> None:
            entry = get_entry(txn, self._dbs, key)
            if entry is None:
                raise InvalidKey(key, "no such entry")
            entry.pinned = pinned
            txn.put(key.encode(), entry.encode(), db=self._dbs["entries"])

        self._index.write(fn)

    def pin(self, key: str) -> None:
        """Exclude an entry from eviction until ``unpin``."""
        self._set_pinned(key, True)

    def unpin(self, key: str) -> None:
        self._set_pinned(key, False)

    @contextmanager
    def lease(self, key: str, *, ttl: float = 86400.0) -> Iterator[LeaseRecord]:
        """Pin ``key`` against gc while this process lives (or until ``ttl``)."""
        validate_key(key)
        record = new_lease_record(key, ttl)
        lease_id = uuid.uuid4().bytes
        self._index.write(lambda txn: txn.put(lease_id, record.encode(), db=self._dbs["leases"]))
        try:
            yield record
        finally:
            self._index.write(lambda txn: txn.delete(lease_id, db=self._dbs["leases"]))

    # -- stats -----------------------------------------------------------
    def record(self, event: str, reason: str | None = None, *, seconds_saved: float = 0.0) -> None:
        """Count a cache event (``hit``, ``miss``, ``bypass``, ``save``, ``eviction``)."""
        with self._lock:
            self._pending_counters.update(dict(event_counters(event, reason, seconds_saved)))
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        """Make sure this process runs a flusher thread (started lazily, again after fork)."""
        if self._flusher_started or self._closed.is_set():
            return
        with self._lock:
            if self._flusher_started:
                return
            self._flusher_started = True
            ref = weakref.ref(self)
            closed = self._closed
            interval = self.flush_interval

            def run() -> None:
                while not closed.wait(interval):
                    store = ref()
                    if store is None:
                        return
                    store.flush()
                    del store

            threading.Thread(target=run, name="adstore-flush", daemon=True).start()

    def flush(self) -> None:
        """Write pending counters and access times (lazy by design, see module doc)."""
        with self._lock:
            counters, self._pending_counters = self._pending_counters, Counter()
            access, self._pending_access = self._pending_access, {}
        if not counters and not access:
            return

        def fn(txn: lmdb.Transaction) -> None:
            for name, delta in counters.items():
                bump(txn, self._dbs["stats"], name, delta)
            for key, (when, hits) in access.items():
                raw_key = key.encode()
                if txn.get(raw_key, None, self._dbs["entries"]) is None:
                    continue  # evicted meanwhile
                recorded = read_access(txn, self._dbs, raw_key)
                if recorded is not None:
                    when, hits = max(recorded[0], when), recorded[1] + hits
                put_access(txn, self._dbs, key, when, hits)

        try:
            self._index.write(fn)
        except Exception as exc:  # bookkeeping must never fail a cache operation
            log.warning("could not flush store counters: %s", exc)

    def size(self) -> int:
        """Physical bytes of all registered blobs (files and inline)."""
        with self._index.read() as txn:
            return read_int(txn, self._dbs["meta"], PHYSICAL)

    def stats(self) -> StoreStats:
        self.flush()
        st = StoreStats()
        with self._index.read() as txn:
            st.counters = read_counters(txn, self._dbs["stats"])
            st.entries = txn.stat(self._dbs["entries"])["entries"]
            st.blobs = txn.stat(self._dbs["blobs"])["entries"]
            st.inline_blobs = txn.stat(self._dbs["blobdata"])["entries"]
            st.leases = txn.stat(self._dbs["leases"])["entries"]
            st.physical_bytes = read_int(txn, self._dbs["meta"], PHYSICAL)
            st.logical_bytes = read_int(txn, self._dbs["meta"], LOGICAL)
            for k, v in txn.cursor(db=self._dbs["entries"]):
                if b'"pin":true' in v:
                    try:
                        st.pinned_bytes += Entry.decode(bytes(k), bytes(v)).bytes
                    except CorruptRecord:
                        pass
        st.index_bytes = sum(f.stat().st_size for f in self.layout.index.iterdir() if f.is_file())
        return st

    # -- gc and verify ---------------------------------------------------
    def plan_eviction(
        self,
        *,
        max_size: int | str | None = None,
        min_free: int | str | None = None,
        older_than: float | str | None = None,
        max_entries: int | None = None,
        namespace: str | None = None,
    ) -> EvictionPlan:
        """LRU entries to evict to meet the budget (honours leases, pins, grace)."""
        self.flush()
        return self._gc.plan_eviction(
            max_size=None if max_size is None else parse_size(max_size, field="max_size"),
            min_free=min_free,
            older_than=None if older_than is None else parse_duration(older_than, field="older_than"),
            max_entries=max_entries,
            namespace=namespace,
        )

    def plan_remove(self, keys: Iterable[str]) -> EvictionPlan:
        return self._gc.plan_remove(keys)

    def plan_sweep(self) -> SweepPlan:
        return self._gc.plan_sweep()

    def verify(self, *, fix: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Rehash every blob and check every invariant; ``fix`` repairs what it can."""
        self.flush()
        return verify_store(
            self._index,
            self.layout,
            fix=fix,
            grace_period=self.grace_period,
            quarantine=self._blobs.quarantine,
            progress=progress,
        )

    def reader_check(self) -> int:
        """Free LMDB reader slots left by killed processes."""
        return self._index.reader_check()

    @property
    def index(self) -> Index:
        return self._index
