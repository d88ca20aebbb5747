"""The two tiers together: restore a local miss from the remote, push a local save to it.

The local store stays tier one and the only thing a pipeline reads; the
remote (:mod:`adstore.store.remote`) is tier two.  A restore fetches this
rank's signed record, pulls the blobs the local store lacks (each verified
by SHA-256 before the store sees it), then publishes and commits a local
manifest under the record's generation, so the next ``Store.lookup`` is an
ordinary local hit.  Anything short of that is a miss with a reason and
leaves nothing committed: pulled blobs that no manifest references are the
store's gc's to sweep.  A save uploads the blobs the remote lacks (HEAD
first), then the record last, inline or through a
:class:`~adstore.store.remote.BackgroundUploader`; a failure is counted,
never raised.  The remote's counters are persisted as ``remote.*`` in the
store's counters, where ``adstore stats`` and the daemon's metrics read
them (docs/remote.md, "Where the remote comes from").

:class:`Tier` is what ``Store.open(root, remote=...)`` attaches: a store
whose lookups that find nothing fall back to :func:`remote_restore` and whose
commits are pushed with :func:`remote_save`, so a caller of the plain store
API (the engine cache among them) gets both tiers without calling either.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

from .errors import AdstoreError, KeyNotFound
from .index.rows import BlobRef, Entry, Manifest
from .lookup import LookupResult
from .reasons import Reason
from .records.format import RECORD_FORMAT, BadRecord, parse_payload, payload_of
from .remote import BackgroundUploader, BlobSink, BlobSource, Outcome, Remote, RemoteConfig

__all__ = [
    "RECORD_FORMAT",
    "record_payload",
    "remote_restore",
    "remote_save",
    "plan_remote_restore",
    "plan_remote_save",
    "BlobPlan",
    "persist_counters",
    "Tier",
    "TieredStore",
    "open_tier",
    "tier_from_env",
]

log = logging.getLogger(__name__)


class TieredStore(BlobSink, BlobSource, Protocol):
    """What the tiers need of :class:`adstore.store.Store` (which imports this module, never the reverse)."""

    @property
    def root(self) -> Path: ...

    def lookup(self, key: str, *, rank: int | None = ..., count: bool = ...) -> LookupResult: ...

    def entry(self, key: str) -> Entry | None: ...

    def manifests(self, key: str) -> list[Manifest]: ...

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


def record_payload(store: TieredStore, key: str, rank: int) -> dict[str, Any]:
    """The record of ``key``'s committed ``rank``: what a remote restore needs to commit it elsewhere.

    Raises :class:`KeyNotFound` when this store has no committed manifest
    of that rank whose blobs are all present.  The payload is the one record
    format (``records.format``, also the store's own on-disk records), without the
    local-only fields (inline bytes, producer).
    """
    return _committed_payload(store, key, rank)[0]


def _committed_payload(store: TieredStore, key: str, rank: int) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """The record payload of ``key``'s committed ``rank`` and its blobs, each once: (digest, size)."""
    found = store.lookup(key, rank=rank, count=False)
    if not found.hit or found.manifest is None:
        raise KeyNotFound(key)
    entry = store.entry(key)
    refs = sorted({(r.digest, r.size) for r in found.manifest.artifacts.values()})
    return payload_of(found.manifest, entry.components if entry is not None else {}), refs


# -- counters ------------------------------------------------------------------
_persisted: weakref.WeakKeyDictionary[Remote, dict[str, dict[str, int]]] = weakref.WeakKeyDictionary()
_persist_lock = threading.Lock()


def persist_counters(store: TieredStore, remote: Remote) -> dict[str, int]:
    """Add what ``remote`` counted since the last call for this store to the store's ``remote.*`` counters."""
    with _persist_lock:
        now = remote.counters
        seen = _persisted.setdefault(remote, {}).setdefault(str(store.root), {})
        delta = {f"remote.{k}": v - seen.get(k, 0) for k, v in now.items() if v != seen.get(k, 0)}
        seen.clear()
        seen.update(now)
    if delta:
        store.count(delta)  # written with the store's other counters, off the lookup path (``bookkeeping``)
    return delta


def _miss(
    store: TieredStore, reason: str, start: float, *, nbytes: int = 0, error: AdstoreError | None = None
) -> Outcome[Manifest]:
    store.count({"remote.misses": 1, f"remote.misses.{reason}": 1})
    return Outcome(reason=reason, error=error, nbytes=nbytes, seconds=time.perf_counter() - start)


# -- restore -------------------------------------------------------------------
def remote_restore(
    store: TieredStore, remote: Remote, key: str, rank: int = 0, world_size: int | None = 1
) -> Outcome[Manifest]:
    """On a local miss: fetch, check, pull and commit ``key``'s ``rank`` locally; the committed manifest.

    The record is checked in full (signature, then the one record parser,
    ``records.format.parse_payload``), and the declared bytes of the blobs this
    store lacks are admitted against its budget and free space, before any
    blob is requested; blobs then stream into place, each within its
    deadline.  ``world_size=None`` takes the record's (a store lookup does
    not know it); the pipeline passes its own, so a record of another
    topology is a miss there.  Never raises.  Reasons: ``absent`` (no
    record), ``untrusted_remote``, ``corrupt_record`` (a signed record that
    does not parse), ``remote_unsupported`` (a newer record format),
    ``topology_mismatch``, ``over_budget``, ``disk_full``,
    ``remote_blob_missing``, ``remote_checksum``, the transport reasons
    (``remote_timeout``...).  ``nbytes`` counts every byte downloaded, record included.
    A record another process of this store committed while this one pulled
    its blobs is a hit (ranks of one host restore the same key together).
    """
    start = time.perf_counter()
    try:
        return _restore(store, remote, key, rank, world_size, start)
    except AdstoreError as exc:
        return _miss(store, str(exc.reason), start, error=exc)
    except Exception as exc:  # a bug must not fail a pipeline, nor print a traceback at a user
        log.error("remote restore of %s rank %d failed unexpectedly: %s: %s", key, rank, type(exc).__name__, exc)
        log.debug("remote restore failure", exc_info=True)
        return _miss(store, str(Reason.REMOTE_ERROR), start, error=AdstoreError(f"{type(exc).__name__}: {exc}"))
    finally:
        persist_counters(store, remote)


def _restore(
    store: TieredStore, remote: Remote, key: str, rank: int, world_size: int | None, start: float
) -> Outcome[Manifest]:
    fetched = remote.fetch_record(key, rank)
    if not fetched.ok or fetched.value is None:
        return _miss(store, fetched.reason or str(Reason.ABSENT), start, nbytes=fetched.nbytes, error=fetched.error)
    nbytes = fetched.nbytes
    try:
        record = parse_payload(fetched.value.payload, f"{remote.url} record of {key} rank {rank}")
    except BadRecord as exc:
        reason = Reason.REMOTE_UNSUPPORTED if exc.reason == Reason.NEWER_RECORD else Reason.CORRUPT_RECORD
        log.warning("remote %s: %s", remote.url, exc)
        return _miss(store, str(reason), start, nbytes=nbytes, error=exc)
    if world_size is None:
        world_size = record.world_size
    if record.world_size != world_size:
        return _miss(store, str(Reason.TOPOLOGY_MISMATCH), start, nbytes=nbytes)
    local = _committed(store, key, rank, record.generation)
    if local is not None:  # this generation is here already (another rank was the one missing)
        return Outcome(value=local, nbytes=nbytes, seconds=time.perf_counter() - start)
    pulled = remote.pull_blobs(
        [(r.digest, r.size) for r in record.artifacts.values()], sink=store, stored=record.stored
    )
    nbytes += pulled.nbytes
    if not pulled.ok:
        return _miss(store, str(pulled.reason), start, nbytes=nbytes, error=pulled.error)
    try:
        store.save(
            key,
            record.artifacts,
            rank=rank,
            world_size=world_size,
            generation=record.generation,
            namespace=record.namespace,
            components=record.components,
            meta={**record.meta, "remote": remote.url, "signer": fetched.value.key_id},
        )
    except AdstoreError:
        # Another process of this store (a rank beside this one) restored the same record while this one
        # pulled its blobs: the generation is committed here, which is what this restore was for.
        if _committed(store, key, rank, record.generation) is None:
            raise
        log.debug("remote restore of %s rank %d: another process committed it first", key, rank)
    check = store.lookup(key, rank=rank, count=False)
    if not check.hit or check.manifest is None:
        return _miss(store, str(check.reason), start, nbytes=nbytes)
    store.count({"remote.hits": 1})
    return Outcome(value=check.manifest, nbytes=nbytes, seconds=time.perf_counter() - start)


def _committed(store: TieredStore, key: str, rank: int, generation: int) -> Manifest | None:
    """This store's committed manifest of ``key`` ``rank`` at ``generation`` with every blob, if any.

    Read from the index alone (a lookup could fall back to the remote again).
    """
    for m in store.manifests(key):
        if m.rank == rank and m.generation == generation and m.committed:
            return m if all(store.has_blob(ref.digest) for ref in m.artifacts.values()) else None
    return None


# -- save ----------------------------------------------------------------------
def remote_save(store: TieredStore, target: Remote | BackgroundUploader, key: str, rank: int = 0) -> Outcome[int]:
    """After the local commit: push ``key``'s ``rank`` (missing blobs HEAD-first, the record last).

    With a :class:`BackgroundUploader` the push is queued and the outcome's
    value is None (a full queue is ``remote_unavailable``); otherwise it runs
    now and the value is the bytes sent.  Never raises; a read-only remote
    sends nothing (``remote_read_only``).
    """
    remote = target.remote if isinstance(target, BackgroundUploader) else target
    start = time.perf_counter()
    if not remote.writable:
        return Outcome(reason=str(Reason.REMOTE_READ_ONLY))
    try:
        payload, refs = _committed_payload(store, key, rank)
    except AdstoreError as exc:
        store.count({f"remote.errors.{exc.reason}": 1})
        return Outcome(reason=str(exc.reason), error=exc, seconds=time.perf_counter() - start)

    def push() -> Outcome[int]:
        try:
            return remote.publish(key, rank, payload, refs, source=store)
        finally:
            persist_counters(store, remote)

    if isinstance(target, BackgroundUploader):
        if target.submit(push, label=f"{key} rank {rank}"):
            return Outcome(seconds=time.perf_counter() - start)
        persist_counters(store, remote)
        return Outcome(reason=str(Reason.REMOTE_UNAVAILABLE), seconds=time.perf_counter() - start)
    out = push()
    return Outcome(
        value=out.value, reason=out.reason, error=out.error, nbytes=out.nbytes, seconds=time.perf_counter() - start
    )


# -- plans (--dry-run) -----------------------------------------------------------
#: A transfer's plan: per blob, (digest, the bytes that would travel, already at the destination).
BlobPlan = list[tuple[str, int, bool]]


def plan_remote_save(store: TieredStore, remote: Remote, key: str, rank: int = 0) -> Outcome[BlobPlan]:
    """What :func:`remote_save` would send for ``key``'s ``rank`` (HEADs only, nothing written); never raises."""
    if not remote.writable:
        return Outcome(reason=str(Reason.REMOTE_READ_ONLY))
    try:
        _payload, refs = _committed_payload(store, key, rank)
    except AdstoreError as exc:
        return Outcome(reason=str(exc.reason), error=exc)
    return remote.plan_publish(refs, source=store)


def plan_remote_restore(
    store: TieredStore | None, remote: Remote, key: str, rank: int = 0, world_size: int | None = 1
) -> Outcome[BlobPlan]:
    """What :func:`remote_restore` would fetch: the record, checked as a restore checks it, and the blobs.

    Only the record is downloaded; a blob ``store`` holds is marked present (``None``: no store yet,
    every blob would come).  Never raises.
    """
    fetched = remote.fetch_record(key, rank)
    if not fetched.ok or fetched.value is None:
        return Outcome(reason=fetched.reason or str(Reason.ABSENT), error=fetched.error, nbytes=fetched.nbytes)
    try:
        record = parse_payload(fetched.value.payload, f"{remote.url} record of {key} rank {rank}")
    except BadRecord as exc:
        reason = Reason.REMOTE_UNSUPPORTED if exc.reason == Reason.NEWER_RECORD else Reason.CORRUPT_RECORD
        return Outcome(reason=str(reason), error=exc, nbytes=fetched.nbytes)
    if world_size is not None and record.world_size != world_size:
        return Outcome(reason=str(Reason.TOPOLOGY_MISMATCH), nbytes=fetched.nbytes)
    refs = sorted({(r.digest, r.size) for r in record.artifacts.values()})
    here = (lambda d: False) if store is None else store.has_blob
    plan = [(d, record.stored[d][1] if d in record.stored else n, here(d)) for d, n in refs]
    return Outcome(value=plan, nbytes=fetched.nbytes)


# -- the tier a store is opened with ---------------------------------------------
def tier_from_env(environ: Mapping[str, str] | None = None) -> Tier | None:
    """The tier ``ADSTORE_REMOTE*`` describe (``Store.from_env``); None, logged, when it cannot be opened.

    Unlike an explicit ``remote=``, a bad environment (an unreadable key
    file, an unknown scheme) must not make every engine compile fail: the
    process runs on its local store alone, as the pipeline cache does.
    """
    try:
        return open_tier(RemoteConfig.from_env(environ))
    except AdstoreError as exc:
        log.warning("remote tier disabled (ADSTORE_REMOTE*): %s", exc)
        return None


def open_tier(spec: str | RemoteConfig | Remote | Tier | None) -> Tier | None:
    """The :class:`Tier` for ``Store.open(remote=...)``: a URL, a :class:`RemoteConfig`, a :class:`Remote` (or a Tier).

    A URL takes the rest of its configuration (mode, keys, timeouts) from
    ``ADSTORE_REMOTE_MODE`` and friends, the URL itself wins over
    ``ADSTORE_REMOTE``.  A configuration that cannot be opened raises
    :class:`ConfigError` here, once, not as misses later.
    """
    if spec is None or isinstance(spec, Tier):
        return spec
    if isinstance(spec, Remote):
        return Tier(spec, owned=False)
    cfg = spec if isinstance(spec, RemoteConfig) else RemoteConfig.from_env(url=str(spec))
    remote = cfg.open()
    return None if remote is None else Tier(remote, owned=True)


#: Local misses a remote can mend: nothing here, ranks missing, ranks of different generations.
_MENDABLE = frozenset({Reason.ABSENT, Reason.INCOMPLETE, Reason.GENERATION_MISMATCH})


class Tier:
    """A store's second tier: a lookup that finds nothing restores from ``remote``; a commit pushes to it.

    Both directions go through :func:`remote_restore` and :func:`remote_save`
    (the pipeline cache and the CLI call the same two), so trust, verification
    and fail-open behaviour are the same everywhere.  While a restore or push
    of this thread runs, the store's own lookups and commits stay local
    (the restore commits, the push looks its entry up), and a restore never
    pushes back what it just fetched.
    """

    #: How many restored keys :meth:`take_restored` remembers (a caller that never asks must not grow it).
    RESTORED_MAX = 256

    def __init__(self, remote: Remote, *, owned: bool = True) -> None:
        self.remote = remote
        self._owned = owned
        self._local = threading.local()
        self._restored: dict[str, int] = {}
        self._restored_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Tier({self.remote!r})"

    @property
    def busy(self) -> bool:
        return bool(getattr(self._local, "busy", False))

    def local_only(self) -> AbstractContextManager[None]:
        """While it is open, this thread's lookups and commits do not reach the remote (a seed's copy)."""
        return self._busy()

    @contextmanager
    def _busy(self) -> Iterator[None]:
        self._local.busy = True
        try:
            yield
        finally:
            self._local.busy = False

    def fallback(self, store: TieredStore, key: str, rank: int | None, missed: LookupResult) -> LookupResult:
        """After a local miss the remote can mend, restore what is missing from it and look again.

        ``absent``: ``rank``, or every rank of the record (rank 0's record
        names the world size).  ``incomplete``: the ranks this store lacks
        (they may have reached the remote since an earlier restore).
        ``generation_mismatch``: every rank, at the remote's generation.  Each
        rank is restored whole or not at all, so a partial restore is never a
        hit.  A miss keeps the remote's reason (``untrusted_remote``,
        ``remote_timeout``, ...) unless the remote simply has no record, which
        keeps the local reason.  With the circuit open this costs about what
        the local miss did: no call, no lock held across anything slow.
        """
        if self.busy or missed.reason not in _MENDABLE:
            return missed
        refused = self.remote.refusal()
        if refused is not None:
            store.count({"remote.fast_fails": 1, "remote.misses": 1, f"remote.misses.{refused}": 1})
            return type(missed)(False, Reason(refused))
        with self._busy():
            outs = self._restore_ranks(store, key, rank, missed)
            failed = next((o for o in outs if not o.ok), None)
            if failed is not None:
                if failed.reason in (None, Reason.ABSENT):
                    return missed
                known = failed.reason in Reason._value2member_map_
                return type(missed)(False, Reason(failed.reason) if known else Reason.REMOTE_ERROR)
            found = store.lookup(key, rank=rank, count=False)
            if not found.hit and found.reason == Reason.GENERATION_MISMATCH and rank is None and found.entry:
                outs += self._restore_ranks(store, key, None, found)  # restored ranks are newer than ours
                found = store.lookup(key, rank=None, count=False)
        if found.hit:
            with self._restored_lock:
                self._restored[key] = self._restored.pop(key, 0) + sum(o.nbytes for o in outs)
                while len(self._restored) > self.RESTORED_MAX:
                    del self._restored[next(iter(self._restored))]
        return found

    def _restore_ranks(
        self, store: TieredStore, key: str, rank: int | None, missed: LookupResult
    ) -> list[Outcome[Manifest]]:
        """Restore the ranks ``missed`` calls for (see :meth:`fallback`), stopping at the first failure."""
        entry = missed.entry
        if rank is not None:
            return [remote_restore(store, self.remote, key, rank, None if entry is None else entry.world_size)]
        if entry is None or missed.reason == Reason.ABSENT:
            first = remote_restore(store, self.remote, key, 0, None)
            if not first.ok or first.value is None:
                return [first]
            world_size, outs = first.value.world_size, [first]
            ranks: Sequence[int] = range(1, world_size)
        else:
            world_size, outs = entry.world_size, []
            ranks = (
                range(world_size)
                if missed.reason == Reason.GENERATION_MISMATCH
                else [r for r in range(world_size) if r not in entry.ranks]
            )
        for other in ranks:
            outs.append(remote_restore(store, self.remote, key, other, world_size))
            if not outs[-1].ok:
                break
        return outs

    def take_restored(self, key: str) -> int | None:
        """Bytes downloaded when a lookup restored ``key`` (once; None if it did not): a hit's ``source=remote``."""
        with self._restored_lock:
            return self._restored.pop(key, None)

    def pushed(self, store: TieredStore, key: str, rank: int) -> Outcome[int] | None:
        """After a local commit: push it (read-write remotes; a failure is counted and logged, never raised)."""
        if self.busy or not self.remote.writable:
            return None
        with self._busy():
            out = remote_save(store, self.remote, key, rank)
        if not out.ok:
            log.warning("remote push of %s rank %d: %s", key, rank, out.reason)
        return out

    def close(self) -> None:
        if self._owned:
            self.remote.close()
