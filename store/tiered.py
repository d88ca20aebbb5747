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
them (README, "Remote tier").

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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .errors import AdstoreError, KeyNotFound
from .reasons import Reason
from .recordfmt import RECORD_FORMAT, payload_of, record_refs
from .records import BlobRef, Manifest
from .remote import BackgroundUploader, Outcome, Remote, RemoteConfig

if TYPE_CHECKING:
    from .lookup import LookupResult
    from .store import Store

__all__ = [
    "RECORD_FORMAT",
    "record_payload",
    "record_refs",
    "remote_restore",
    "remote_save",
    "persist_counters",
    "Tier",
    "open_tier",
    "tier_from_env",
]

log = logging.getLogger(__name__)


def record_payload(store: Store, key: str, rank: int) -> dict[str, Any]:
    """The record of ``key``'s committed ``rank``: what a remote restore needs to commit it elsewhere.

    Raises :class:`KeyNotFound` when this store has no committed manifest
    of that rank whose blobs are all present.  The payload is the one record
    format (``recordfmt``, also the store's own on-disk records), without the
    local-only fields (inline bytes, producer).
    """
    found = store.lookup(key, rank=rank, record=False)
    if not found.hit or found.manifest is None:
        raise KeyNotFound(key)
    entry = store.entry(key)
    return payload_of(found.manifest, entry.components if entry is not None else {})


def _unique(refs: dict[str, BlobRef]) -> list[tuple[str, int]]:
    return sorted({(r.digest, r.size) for r in refs.values()})


# -- counters ------------------------------------------------------------------
_persisted: weakref.WeakKeyDictionary[Remote, dict[str, dict[str, int]]] = weakref.WeakKeyDictionary()
_persist_lock = threading.Lock()


def persist_counters(store: Store, remote: Remote) -> dict[str, int]:
    """Add what ``remote`` counted since the last call for this store to the store's ``remote.*`` counters."""
    with _persist_lock:
        now = remote.counters
        seen = _persisted.setdefault(remote, {}).setdefault(str(store.root), {})
        delta = {f"remote.{k}": v - seen.get(k, 0) for k, v in now.items() if v != seen.get(k, 0)}
        seen.clear()
        seen.update(now)
    if delta:
        store.count(delta)
        store.flush()  # a remote call costs far more than this write; stats in other processes see it now
    return delta


def _miss(store: Store, reason: str, start: float, *, nbytes: int = 0,
          error: AdstoreError | None = None) -> Outcome[Manifest]:
    store.count({"remote.misses": 1, f"remote.misses.{reason}": 1})
    return Outcome(reason=reason, error=error, nbytes=nbytes, seconds=time.perf_counter() - start)


# -- restore -------------------------------------------------------------------
def remote_restore(store: Store, remote: Remote, key: str, rank: int = 0,
                   world_size: int | None = 1) -> Outcome[Manifest]:
    """On a local miss: fetch, verify, pull and commit ``key``'s ``rank`` locally; the committed manifest.

    ``world_size=None`` takes the record's (a store lookup does not know
    it); the pipeline passes its own, so a record of another topology is a
    miss there.  Never raises.  Reasons: ``absent`` (no record), ``untrusted_remote``,
    ``remote_blob_missing``, ``remote_checksum``, ``topology_mismatch`` (a
    record of another world size), ``remote_unsupported`` (a newer record
    format), the transport reasons, and the store's own (``disk_full``...).
    ``nbytes`` counts every byte downloaded, record included.
    """
    start = time.perf_counter()
    try:
        return _restore(store, remote, key, rank, world_size, start)
    except AdstoreError as exc:
        return _miss(store, str(exc.reason), start, error=exc)
    except Exception as exc:  # a bug must not fail a pipeline
        log.exception("remote restore of %s rank %d failed unexpectedly", key, rank)
        return _miss(store, str(Reason.REMOTE_ERROR), start, error=AdstoreError(f"{type(exc).__name__}: {exc}"))
    finally:
        persist_counters(store, remote)


def _restore(store: Store, remote: Remote, key: str, rank: int, world_size: int | None,
             start: float) -> Outcome[Manifest]:
    fetched = remote.fetch_record(key, rank)
    if not fetched.ok or fetched.value is None:
        return _miss(store, fetched.reason or str(Reason.ABSENT), start, nbytes=fetched.nbytes, error=fetched.error)
    nbytes = fetched.nbytes
    payload = fetched.value.payload
    if not isinstance(payload.get("format"), int) or payload["format"] > RECORD_FORMAT:
        return _miss(store, str(Reason.REMOTE_UNSUPPORTED), start, nbytes=nbytes)
    if world_size is None:
        world_size = payload.get("world_size")
        if not isinstance(world_size, int) or isinstance(world_size, bool):
            return _miss(store, str(Reason.REMOTE_UNSUPPORTED), start, nbytes=nbytes)
    if payload.get("world_size") != world_size:
        return _miss(store, str(Reason.TOPOLOGY_MISMATCH), start, nbytes=nbytes)
    refs = record_refs(payload)
    pulled = remote.pull_blobs(_unique(refs), sink=store)
    nbytes += pulled.nbytes
    if not pulled.ok:
        return _miss(store, str(pulled.reason), start, nbytes=nbytes, error=pulled.error)
    generation = int(payload["generation"])
    components = payload.get("components") or {}
    store.publish(key, rank=rank, world_size=world_size, generation=generation, artifacts=refs,
                  namespace=str(payload.get("namespace", "default")), components=components,
                  meta={**(payload.get("meta") or {}), "remote": remote.url, "signer": fetched.value.key_id})
    try:
        store.commit(key, rank=rank, generation=generation, components=components)
    except BaseException:
        store.abort(key, rank=rank, generation=generation)
        raise
    check = store.lookup(key, rank=rank, record=False)
    if not check.hit or check.manifest is None:
        return _miss(store, str(check.reason), start, nbytes=nbytes)
    store.count({"remote.hits": 1})
    return Outcome(value=check.manifest, nbytes=nbytes, seconds=time.perf_counter() - start)


# -- save ----------------------------------------------------------------------
def remote_save(store: Store, target: Remote | BackgroundUploader, key: str, rank: int = 0) -> Outcome[int]:
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
        payload = record_payload(store, key, rank)
        refs = _unique(record_refs(payload))
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
    return Outcome(value=out.value, reason=out.reason, error=out.error, nbytes=out.nbytes,
                   seconds=time.perf_counter() - start)


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

    @contextmanager
    def _busy(self) -> Iterator[None]:
        self._local.busy = True
        try:
            yield
        finally:
            self._local.busy = False

    def fallback(self, store: Store, key: str, rank: int | None, missed: LookupResult) -> LookupResult:
        """After a local ``absent``: restore ``key`` (``rank``, or every rank of the record) and look again.

        A miss keeps the remote's reason (``untrusted_remote``, ``remote_timeout``,
        ...) unless the remote simply has no record, which stays ``absent``.
        """
        if self.busy:
            return missed
        with self._busy():
            outs = [remote_restore(store, self.remote, key, 0 if rank is None else rank, None)]
            if outs[0].ok and outs[0].value is not None and rank is None:
                world_size = outs[0].value.world_size
                for other in range(1, world_size):
                    outs.append(remote_restore(store, self.remote, key, other, world_size))
                    if not outs[-1].ok:
                        break
            failed = outs[-1]
            if not failed.ok:
                if failed.reason in (None, Reason.ABSENT):
                    return missed
                known = failed.reason in Reason._value2member_map_
                return type(missed)(False, Reason(failed.reason) if known else Reason.REMOTE_ERROR)
            with self._restored_lock:
                self._restored[key] = self._restored.pop(key, 0) + sum(o.nbytes for o in outs)
                while len(self._restored) > self.RESTORED_MAX:
                    del self._restored[next(iter(self._restored))]
            return store.lookup(key, rank=rank, record=False)

    def take_restored(self, key: str) -> int | None:
        """Bytes downloaded when a lookup restored ``key`` (once; None if it did not): a hit's ``source=remote``."""
        with self._restored_lock:
            return self._restored.pop(key, None)

    def pushed(self, store: Store, key: str, rank: int) -> Outcome[int] | None:
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
