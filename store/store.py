"""The store facade: blobs, manifests, entries, leases, stats, budget, gc, verify.

One ``Store`` per process and root is the intended use; it is safe to use from threads, after ``fork`` (the
index reopens), and from many processes at once (LMDB serialises writers; blob files are published atomically).
Each concern lives in its own module; this class wires them to one root (docs/architecture.md, "How an entry lives").
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .blobs import Blobs, StoredBlob
from .blobwriter import BlobWriter
from .bookkeeping import Bookkeeping, flush_root
from .clock import Clock, system_clock
from .codec import Encoding
from .errors import CorruptRow, InvalidKey, ReadOnlyStore, StoreError
from .fsutil import unique_temp
from .index.ballast import Ballast
from .index.env import Index
from .index.rows import BlobRef, Entry, LeaseRow, Manifest
from .index.schema import PHYSICAL_BYTES
from .index.tables import Tables
from .layout import Layout, default_root
from .leases import DEFAULT_PUBLISH_TIMEOUT, new_lease_row
from .lookup import LookupMemo, LookupResult, lookup, resolve_key
from .maintenance.budget import BUDGET, DEFAULT_GRACE_PERIOD, Budget, read_budget
from .maintenance.inline import InlineEviction
from .maintenance.reservations import Reservation
from .manifests import set_pinned
from .names import validate_key
from .publishing import Artifacts, Publisher
from .reasons import Reason
from .records.obsolete import obsolete_dropped
from .records.sync import RecordWriter
from .seal import Seals
from .seed import Seed, open_seed
from .stats import StoreStats, entry_stored_bytes, event_counters, read_stats
from .units import parse_duration, parse_size
from .upkeep import Upkeep

if TYPE_CHECKING:  # the remote tier loads with the first store that has one
    from .tiered import Tier

__all__ = ["Store", "DEFAULT_INLINE_THRESHOLD"]

log = logging.getLogger(__name__)

DEFAULT_INLINE_THRESHOLD = 64 << 10
DEFAULT_MAP_SIZE = 1 << 30


class Store(Upkeep):
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
        create: bool = True,
        memoize_lookups: bool = True,
        remote: Any = None,
        seed: str | os.PathLike[str] | Seed | None = None,
        read_only: bool = False,
        clock: Clock = system_clock,
        publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT,
    ) -> None:
        self.root = Path(root).expanduser().absolute()
        layout = Layout(self.root)
        #: Serves lookups and reads, writes nothing (``read_only=True``, or the root is on a read-only mount);
        #: every write raises :class:`ReadOnlyStore` (docs/operations.md, "A read-only store").
        self.read_only = layout.prepare(read_only=read_only, create=create, check_permissions=check_permissions)
        self.grace_period = float(grace_period)
        self.publish_timeout = float(publish_timeout)  #: how long gc waits for a live publisher's commit (leases)
        self.inline_threshold = int(inline_threshold)
        #: The hard limit of this writer (else the persisted budget's; see ``inline``).
        self.max_size = max_size
        self._map_size = map_size
        self._memoize = memoize_lookups
        self._flush_interval = flush_interval
        self.clock = clock  #: wall-clock seconds for every time the store keeps (``clock``; tests inject one)
        self.tier: Tier | None = None  # the second tier, see ``open``; a bad one raises before the index opens
        if remote is not None:
            from .tiered import open_tier  # the remote tier is imported only by stores that have one

            self.tier = open_tier(remote)
        # A read-only store searched after this one, before the remote (``seed``).
        self.seed = None if seed is None else open_seed(seed, root=self.root, opener=Store._seed_opener(clock))
        self._attach(layout)
        self._open = True

    @staticmethod
    def _seed_opener(clock: Clock = system_clock) -> Callable[[Path], Store]:
        return lambda path: Store(path, read_only=True, create=False, check_permissions=False, clock=clock)

    def _attach(self, layout: Layout) -> None:
        """Open the index and wire every part of the store to it (again after a rebuild)."""
        self._index = Index.acquire(
            layout.index, map_size=self._map_size, group_shared=layout.group_shared, read_only=self.read_only
        )
        if self._index.ballast is None and not self.read_only:
            self._index.ballast = Ballast(layout.root)
            self._index.ballast.ensure()
        self._tables = Tables(self._index, layout, self.clock, after_commit=obsolete_dropped)
        # A read-only store keeps its counters and access times in memory (``stats`` adds them).
        self._book = Bookkeeping(self._tables, flush_interval=self._flush_interval, persist=not self.read_only)
        # Measured in bench_store.py: the memo halves a repeated lookup (docs/architecture.md, "How an entry lives").
        self._memo: LookupMemo | None = LookupMemo() if self._memoize else None
        self._inline = InlineEviction(self._tables, max_size=self.max_size, grace_period=self.grace_period)
        self._blobs = Blobs(
            self._tables,
            inline_threshold=self.inline_threshold,
            grace_period=self.grace_period,
            reserve=self._inline.reserve,
            on_dedup=self._count_dedup,
            read_only=self.read_only,
        )
        self._records = RecordWriter(self._tables)  # invariant 9: the files a lost index is rebuilt from
        self._seals = Seals(self._records.files, self._book.count)  # entries that become code: rows vs record
        push = lambda key, rank: self.tier and self.tier.pushed(self, key, rank)  # noqa: E731 - after each commit
        self._publisher = Publisher(
            self._tables, self._records, self._blobs.file_ok, pushed=push, publish_timeout=self.publish_timeout
        )

    # -- construction ----------------------------------------------------
    @classmethod
    def open(cls, root: str | os.PathLike[str] | None = None, **settings: Any) -> Store:
        """Open the store at ``root`` or the default root, creating it unless ``create=False``.

        With ``create=False`` (the CLI's read-only commands) a root without a
        store raises :class:`NoStore` and nothing is created.  ``remote=`` (URL, ``RemoteConfig``,
        ``Remote``): a lookup that finds nothing restores from it, a commit is pushed (``tiered.Tier``).
        ``seed=PATH``: a read-only store searched after this one and before the remote; its hits are copied
        in (``seed.Seed``).  ``read_only=True``: serve lookups and reads, refuse every write (a store on a
        read-only mount is read-only whatever this says).
        """
        return cls(default_root() if root is None else root, **settings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Store:
        """The store ``ADSTORE_ROOT``, ``ADSTORE_MAX_SIZE``, ``ADSTORE_GRACE_PERIOD``, ``ADSTORE_PUBLISH_TIMEOUT``,
        ``ADSTORE_SEED``, ``ADSTORE_REMOTE*`` name.  A seed or remote that cannot be opened is logged and left out."""
        env = os.environ if environ is None else environ
        settings: dict[str, Any] = {}
        if env.get("ADSTORE_SEED", "").strip() and "seed" not in overrides:  # logged and left out if it fails
            opener = cls._seed_opener(overrides.get("clock", system_clock))
            settings["seed"] = open_seed(
                env["ADSTORE_SEED"].strip(), root=default_root(env), opener=opener, environ=env
            )
        if env.get("ADSTORE_REMOTE", "").strip() and "remote" not in overrides:
            from .tiered import tier_from_env

            settings["remote"] = tier_from_env(env)  # a remote that cannot be opened is logged, not raised
        if env.get("ADSTORE_MAX_SIZE"):
            settings["max_size"] = parse_size(env["ADSTORE_MAX_SIZE"], field="ADSTORE_MAX_SIZE")
        for name, setting in (("ADSTORE_GRACE_PERIOD", "grace_period"), ("ADSTORE_PUBLISH_TIMEOUT", "publish_timeout")):
            if env.get(name):
                settings[setting] = parse_duration(env[name], field=name)
        settings.update(overrides)
        return cls(default_root(env), **settings)

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self.tier is not None:
            self.tier.close()
        if self.seed is not None:
            self.seed.close()
        self._book.close()
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
            self._forget_checks()
            raise

    def copy_blob_to(
        self,
        ref_or_digest: BlobRef | str,
        dest: str | os.PathLike[str],
        *,
        check: Callable[[os.stat_result | None], None] | None = None,
    ) -> Path:
        """Copy a blob's verified content to ``dest``; ``check`` judges the file it is read from (``Blobs.copy_to``)."""
        try:
            return self._blobs.copy_to(ref_or_digest, dest, check=check)
        except StoreError:
            self._forget_checks()
            raise

    def require_writable(self, what: str) -> None:
        """Refuse ``what`` on a read-only store, before anything is written (:class:`ReadOnlyStore`)."""
        if self.read_only:
            raise ReadOnlyStore(str(self.root), what)

    def _forget_checks(self) -> None:
        """A read failed: re-check every entry in full from now on."""
        if self._memo is not None:
            self._memo.clear()

    def has_blob(self, ref_or_digest: BlobRef | str) -> bool:
        return self._blobs.has(ref_or_digest)

    def stored_blob(self, ref_or_digest: BlobRef | str) -> StoredBlob | None:
        """A file blob's path, encoding (raw or zstd-compressed, ``codec``) and size on disk; None if inline."""
        return self._blobs.stored(ref_or_digest)

    def blob_path(self, ref_or_digest: BlobRef | str) -> Path | None:
        return self._blobs.path(ref_or_digest)

    def blob_writer(
        self,
        ref: BlobRef,
        *,
        source: Encoding = Encoding.RAW,
        frame_size: int | None = None,
        cancelled: threading.Event | None = None,
    ) -> BlobWriter:
        """A writer streaming the blob ``ref`` into place as its bytes arrive, hashed once (``blobwriter``).

        Bytes from elsewhere (the remote tier; :meth:`admit` them first) are
        registered only if they hash (``source=ZSTD``: decode) to ``ref``.
        """
        return self._blobs.writer(ref, source=source, frame_size=frame_size, cancelled=cancelled)

    def admit(self, nbytes: int) -> Reservation:
        """Reserve room for ``nbytes`` to download (until consumed or released), or OverBudget / StoreFull."""
        self.require_writable("storing a blob")
        return self._inline.admit(nbytes)

    def temp_path(self, suffix: str = ".tmp") -> Path:
        """A unique path in the store's ``tmp/`` (same filesystem as the blobs; swept past the grace period)."""
        self.require_writable("a temp file")
        return unique_temp(self._tables.layout.tmp, suffix)

    def quarantine(self, digest: str) -> None:
        self._blobs.quarantine(digest)

    def _count_dedup(self, size: int) -> None:
        self._book.count({"bytes_deduplicated": size})

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
        """Record this rank's manifest, uncommitted (blobs stored already): :meth:`save` short of its commit."""
        self.require_writable("publish")
        manifest = self._publisher.save(
            key,
            artifacts,
            rank=rank,
            world_size=world_size,
            generation=generation,
            namespace=namespace,
            components=components,
            meta=meta,
            commit=False,
        )
        assert manifest is not None  # without ``agree`` only a failure, raised, stops a save
        return manifest

    def save(
        self,
        key: str,
        artifacts: Artifacts,
        *,
        rank: int = 0,
        world_size: int = 1,
        generation: int | None = None,
        namespace: str = "default",
        components: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        agree: Callable[[bool], bool] | None = None,
        trusted: frozenset[int] | None = None,
    ) -> Manifest | None:
        """Publish this rank's manifest and commit it; on any failure nothing stays: the one publish path.

        ``artifacts``: stored blobs, or a function storing them.  ``agree``: for ranks saving together, the
        collective told whether this rank published, answering whether all did (None when they did not).
        ``trusted``: the entry becomes code, read by users who trust these uids; a blob file another user
        owns (deduplicated) or others may write is one those readers refuse, so nothing is published and
        None returned (counted ``untrusted_dedup``; docs/architecture.md, "Records").
        """
        self.require_writable("save")
        generation = self.new_generation() if generation is None else generation
        return self._publisher.save(
            key,
            artifacts,
            rank=rank,
            world_size=world_size,
            generation=generation,
            namespace=namespace,
            components=components,
            meta=meta,
            agree=agree,
            vet=None if trusted is None else lambda refs: self._seals.vet(key, refs, trusted, self._blobs.stored),
        )

    def commit(
        self, key: str, *, rank: int = 0, generation: int, components: Mapping[str, Any] | None = None
    ) -> Manifest:
        """Make a published manifest restorable; releases the rank's older generation."""
        self.require_writable("commit")
        return self._publisher.commit(key, rank=rank, generation=generation, components=components)

    def abort(self, key: str, *, rank: int = 0, generation: int) -> bool:
        """Drop an uncommitted manifest (a failed save); returns whether one was dropped."""
        self.require_writable("abort")
        return self._publisher.abort(key, rank=rank, generation=generation)

    def lookup(
        self,
        key: str,
        *,
        rank: int | None = None,
        count: bool = True,
        trusted: frozenset[int] | None = None,
        local: bool = False,
    ) -> LookupResult:
        """A hit only when invariants 5-6 hold, else a miss with a reason; ``count=False``: not counted.

        ``trusted``: the entry becomes code.  Each manifest hit must then agree with its record file, written
        by a trusted uid and writable by no one else, else the lookup is a miss ``unsealed_entry`` (:mod:`.seal`).
        None: the index rows are believed as they are.  ``local``: this store's rows only (no seed, no remote).
        """
        validate_key(key)
        try:
            with self._tables.read() as t:
                result = lookup(t, key, rank, self._blobs.file_ok, self._memo)
        except CorruptRow as exc:  # a bad row, or a damaged index (docs/operations.md, "Damage and repair")
            log.warning("lookup of %s: %s", key, exc)
            self._forget_checks()
            result = LookupResult(False, Reason.CORRUPT_INDEX)
        if self.seed is not None and not result.hit and not self.read_only and not local:  # a copy would write
            with self.tier.local_only() if self.tier is not None else nullcontext():  # a copy is not pushed
                result = self.seed.fallback(self, key, rank, result)
        if self.tier is not None and not result.hit and not self.read_only and not local:  # a restore would write
            result = self.tier.fallback(self, key, rank, result)
        if result.hit and trusted is not None:  # after the memo and the remote: every trusted hit is checked
            result = self._seals.sealed(key, result, trusted)
        if result.hit:
            self._book.hit(key, count=count)
        elif count:
            self._book.count({"misses": 1, f"misses.{result.reason}": 1})
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
        with self._tables.read() as t:
            entry = t.entry(key)
            if entry is not None:
                entry.components = t.components(key)
            return entry

    def entries(self, namespace: str | None = None) -> Iterator[Entry]:
        """Every entry, without components (undecodable rows are skipped with a warning)."""
        with self._tables.read() as t:
            out = [t.with_access(e) for e, _ in t.entries() if namespace is None or e.namespace == namespace]
        return iter(out)

    def resolve_key(self, prefix: str) -> str:
        """The one entry key equal to or starting with ``prefix`` (like a short git hash); :class:`KeyNotFound`
        when none matches, :class:`AmbiguousKey` (with every candidate) when several do."""
        return resolve_key(self._tables, prefix)

    def stored_bytes(self, keys: Iterable[str]) -> dict[str, int]:
        """What each entry's current blobs take on disk (a blob shared by entries counts in each)."""
        return entry_stored_bytes(self._tables, [validate_key(k) for k in keys])

    def manifests(self, key: str) -> list[Manifest]:
        validate_key(key)
        with self._tables.read() as t:
            return list(t.manifests_of(key))

    def _set_pinned(self, key: str, pinned: bool) -> None:
        validate_key(key)
        self.require_writable("pin" if pinned else "unpin")
        self._tables.write(lambda t: set_pinned(t, key, pinned))
        self._records.pinned(key, pinned)

    def pin(self, key: str) -> None:
        """Exclude an entry from eviction until ``unpin``."""
        self._set_pinned(key, True)

    def unpin(self, key: str) -> None:
        self._set_pinned(key, False)

    @contextmanager
    def lease(self, key: str, *, ttl: float = 86400.0) -> Iterator[LeaseRow]:
        """Pin ``key`` against gc while this process lives (or until ``ttl``); a read-only store has no gc: no-op."""
        validate_key(key)
        if self.read_only:
            yield new_lease_row(key, ttl, self._tables.clock())
            return
        record = new_lease_row(key, ttl, self._tables.clock())
        lease_id = uuid.uuid4().bytes
        self._tables.write(lambda t: t.put_lease(lease_id, record))
        try:
            yield record
        finally:
            self._tables.write(lambda t: t.drop_lease(lease_id))

    # -- stats and budget ------------------------------------------------
    def count_event(self, event: str, reason: str | None = None, *, seconds_saved: float = 0.0) -> None:
        """Count a cache event (``hit``, ``miss``, ``bypass``, ``save``, ``eviction``)."""
        self._book.count(dict(event_counters(event, reason, seconds_saved)))

    def count(self, counts: Mapping[str, int]) -> None:
        """Add to named counters (``remote.bytes_down``...): persisted like ``count_event``'s, shown by ``stats``."""
        self._book.count({str(k): int(v) for k, v in counts.items() if v})

    def flush(self) -> None:
        """Write pending counters and access times (lazy by design, see ``bookkeeping``)."""
        self._book.flush()

    def size(self) -> int:
        """Physical bytes of all registered blobs (files and inline)."""
        with self._tables.read() as t:
            return t.total(PHYSICAL_BYTES)

    def stats(self, *, unreferenced: bool = False) -> StoreStats:
        """Counters and totals of this root (``unreferenced``: also scan for blobs no manifest references)."""
        flush_root(self._tables.layout.root)
        stats = read_stats(self._tables, unreferenced=unreferenced)
        for name, n in self._book.pending().items():  # a read-only store's counters live in memory only
            stats.counters[name] = stats.counters.get(name, 0) + n
        return stats

    def set_budget(self, budget: Budget) -> None:
        """Persist the budget the daemon enforces (``adstore stats`` and writers read it)."""
        self._tables.write(lambda t: t.put_meta(BUDGET, budget.encode()))

    def budget(self) -> Budget | None:
        """The persisted budget, or None if no daemon ever set one."""
        with self._tables.read() as t:
            return read_budget(t)

    def reader_check(self) -> int:
        """Free LMDB reader slots left by killed processes."""
        return self._index.reader_check()

    @property
    def index(self) -> Index:
        return self._index
