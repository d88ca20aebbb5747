"""The pipeline cache's remote tier: restore a local miss from the remote, push a save to it.

The pipeline cache calls :func:`prefetch` before its own restore and
:func:`push` after a save; both are no-ops without a remote (the
``remote`` setting of ``pipeline_cache``, else ``ADSTORE_REMOTE`` read when
the pipeline runs).  A prefetch that restores commits this rank's record in
the local store, so the cache's ordinary restore (lookup, rank agreement,
load) then finds it: ranks still agree through the collectives and each
rank restores only its own record.  :func:`mark` relabels that hit's event
``source="remote"`` with the bytes transferred.

When a rank finds no record and every rank's remote is read-write, the host
takes a single-flight build lease: rank 0 acquires it and broadcasts its role
through the agreement group (:mod:`~adstore.integration.coordination.dist`), so
all ranks of one host build together or wait together.  A leading host builds
and pushes every rank's record, meets at a barrier, then rank 0 releases; on a
following host each rank waits a bounded time (``ADSTORE_REMOTE_WAIT``,
default 300 s) for every rank's record and restores its own, or builds when
the wait ends or the builder is gone.  The wait is not a collective, so it may
outlast the process group's timeout; ranks whose waits ended differently are
settled by the cache's rank agreement (any miss: every rank builds).
At world size 1 the collectives are no-ops.  The collectives run only when a
remote is named (``remote`` or ``ADSTORE_REMOTE``, the same on every rank),
whether or not it opened on this rank, so no rank skips one its peers make.
Everything fails open: the remote can turn a miss into a hit, never a hit
into a failure (docs/remote.md, "Single-flight cold starts").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from adstore.integration.coordination.dist import all_true, barrier, broadcast_int
from adstore.integration.coordination.events import EventKind, Source
from adstore.store import Reason, parse_duration
from adstore.store.remote import Flight, Outcome, Role, SingleFlight, record_address

if TYPE_CHECKING:  # the client and the tier's transfers load with the first remote (a warm restart has none)
    from adstore.store.remote import BackgroundUploader, Remote

__all__ = ["HeldFlight", "remote_for", "prefetch", "mark", "push", "stage_flight", "wait_seconds"]

log = logging.getLogger(__name__)

#: Seconds a follower waits for a single-flight leader's record before building itself.
DEFAULT_FLIGHT_WAIT = 300.0

#: Caches whose host leads a build: the lease (rank 0) or None (the other ranks, which only meet at the barrier).
_FLIGHTS: weakref.WeakKeyDictionary[Any, tuple[SingleFlight, Flight | None]] = weakref.WeakKeyDictionary()
#: A role travels between ranks as its index here.
_ROLES = (Role.LEADER, Role.FOLLOWER, Role.SOLO)
_OPEN: dict[str, tuple[Remote, BackgroundUploader | None]] = {}
_OPEN_LOCK = threading.Lock()


def remote_for(url: str | None, *, background: bool = False) -> tuple[Remote, BackgroundUploader | None] | None:
    """The process's one :class:`Remote` for ``url`` (or ``ADSTORE_REMOTE``), None without one.

    One per configuration, so its circuit breaker spans every pipeline of
    the process; a configuration that cannot be opened (bad key file,
    unknown scheme) is logged once per call and means "no remote".
    """
    if not (url or os.environ.get("ADSTORE_REMOTE", "").strip()):
        return None  # no remote: the remote tier is not even imported
    try:
        from adstore.store.remote import BackgroundUploader, RemoteConfig

        cfg = RemoteConfig.from_env(**({"url": url} if url else {}))
        if not cfg.enabled:
            return None
        name = json.dumps([cfg.describe(), background], sort_keys=True, default=str)
        with _OPEN_LOCK:
            if name not in _OPEN:
                remote = cfg.open()
                assert remote is not None
                _OPEN[name] = (remote, BackgroundUploader(remote) if background else None)
            return _OPEN[name]
    except Exception as exc:
        log.warning("remote tier disabled for this run: %s", exc)
        return None


def prefetch(cache: Any, ctx: Any) -> Outcome[Any] | None:
    """Before the cache restores: on a local miss of this rank, restore it from the remote.

    ``cache`` is the ``PipelineCache`` (its ``cfg``, ``key`` and ``store``);
    returns the remote outcome, or None when the remote was not asked.  A
    collective at world size > 1 whenever a remote is named (module docstring).
    """
    cfg = cache.cfg
    if not (cfg.enabled and cfg.restore):
        return None
    url = getattr(cfg, "remote", None)
    if not (url or os.environ.get("ADSTORE_REMOTE", "").strip()):
        return None
    opened = remote_for(url)
    remote = opened[0] if opened is not None else None
    out = _restore_own(cache, ctx, remote)
    absent = out is not None and out.reason == Reason.ABSENT
    # Every rank reaches these collectives, whatever happened to it above.
    if all_true(not absent) or not all_true(remote is not None and remote.writable):
        return out
    assert remote is not None
    return _single_flight(cache, ctx, remote, out)


def _restore_own(cache: Any, ctx: Any, remote: Remote | None) -> Outcome[Any] | None:
    """This rank's local miss restored from the remote; None when it hit locally or the remote was not asked."""
    if remote is None:
        return None
    try:
        key = cache.key(ctx).key
        store = cache.store()
        if store.lookup(key, rank=ctx.rank, count=False).hit:
            return None
    except Exception as exc:  # the cache's own restore reports this failure
        log.debug("remote prefetch skipped: %s", exc)
        return None
    from adstore.store import remote_restore

    return remote_restore(store, remote, key, ctx.rank, ctx.world_size)


def _single_flight(cache: Any, ctx: Any, remote: Remote, missed: Outcome[Any] | None) -> Outcome[Any] | None:
    """Some rank has no record anywhere: rank 0 leads or follows for the host, every rank acts on its word."""
    flights = SingleFlight(remote)
    flight: Flight | None = None
    role = Role.SOLO
    if ctx.rank == 0:
        try:
            flight = flights.acquire(cache.key(ctx).key)
            role = flight.role
        except Exception:  # acquire never raises; a key that cannot be computed here: build
            log.exception("single-flight lease not taken")
    role = _ROLES[broadcast_int(_ROLES.index(role))]
    if role is Role.LEADER:
        _FLIGHTS[cache] = (flights, flight)  # released by push() once every rank's record is up
        return missed
    if role is not Role.FOLLOWER:
        return missed
    if missed is None:
        return None  # this rank has its entry locally: nothing to wait for
    # Each rank waits on its own (no collective may outlast the process group's timeout) for every
    # rank's record; ranks that end up disagreeing are settled by the cache's own rank agreement.
    try:
        key = cache.key(ctx).key
    except Exception:
        return missed
    following = flight if flight is not None else Flight(key, Role.FOLLOWER)
    ranks = range(ctx.world_size)
    waited = flights.wait(
        following,
        timeout=wait_seconds(),
        ready=lambda: all(remote.head("ac", record_address(key, r)).value is not None for r in ranks),
    )
    if not waited.ready:
        log.info("single-flight wait for %s ended (%s): building here", key, waited.reason)
        return missed
    from adstore.store import remote_restore

    return remote_restore(cache.store(), remote, key, ctx.rank, ctx.world_size)


def wait_seconds() -> float:
    raw = os.environ.get("ADSTORE_REMOTE_WAIT", "").strip()
    try:
        return parse_duration(raw, field="ADSTORE_REMOTE_WAIT") if raw else DEFAULT_FLIGHT_WAIT
    except Exception as exc:
        log.warning("%s; waiting %.0fs", exc, DEFAULT_FLIGHT_WAIT)
        return DEFAULT_FLIGHT_WAIT


@dataclass
class HeldFlight:
    """A single-flight lease this host takes part in: rank 0 holds ``flight``; the other ranks hold None.

    A leading host's ranks meet at a barrier before rank 0 releases, so
    followers never see the lease gone before every rank's record is up.
    """

    flights: SingleFlight
    flight: Flight | None
    role: Role = Role.LEADER

    def release(self) -> None:
        """Rank 0 drops the lease (no collective; see :meth:`finish`)."""
        if self.flight is not None and self.flight.leader:
            self.flights.release(self.flight)
            self.flight = None

    def finish(self) -> None:
        """Every rank of a leading host: meet at a barrier, then rank 0 releases (a collective)."""
        try:
            barrier()
        except Exception:
            log.exception("single-flight barrier failed; releasing the lease anyway")
        self.release()


def stage_flight(lease_key: str | None, remote: Remote | None, *, absent: bool, rank: int) -> HeldFlight | None:
    """A stage after the cache point found nothing anywhere: lead, follow or build alone, on its own lease.

    ``lease_key`` names what the stage makes, the same on every rank of a
    host (the compile stage's: its key without the rank's own parts), so
    when several hosts start one cold stage, one compiles, and a host that
    compiles another stage under the same cache point (other options, other
    input shapes) never waits for it.  A collective at world size > 1:
    call it on every rank whenever a remote is named, whatever happened on
    this rank (``absent``: this rank found nothing, locally or remotely).
    Returns the lease to lead under (``role`` leader: build, then
    :meth:`HeldFlight.finish`) or to wait on (follower), or None (build alone).
    """
    if all_true(not absent) or not all_true(remote is not None and remote.writable and lease_key is not None):
        return None
    assert remote is not None and lease_key is not None
    flights = SingleFlight(remote)
    flight: Flight | None = None
    role = Role.SOLO
    if rank == 0:
        try:
            flight = flights.acquire(lease_key, heartbeat=_HEARTBEAT)
            role = flight.role
        except Exception:  # acquire never raises; build alone
            log.exception("single-flight lease not taken")
    role = _ROLES[broadcast_int(_ROLES.index(role))]
    if role is Role.SOLO:
        return None
    return HeldFlight(flights, flight if flight is not None or role is Role.LEADER else Flight(lease_key, role), role)


#: Seconds between renewals of a lease a compile stage leads under (compiles of large models run long).
_HEARTBEAT = 60.0


def mark(cache: Any, fetched: Outcome[Any] | None, module: Any) -> Any:
    """After the cache restored: label the hit ``remote`` when the prefetch produced it; returns ``module``."""
    if module is not None and fetched is not None and fetched.ok and cache.events:
        last = cache.events[-1]
        if last.kind == EventKind.HIT:
            cache.events[-1] = dataclasses.replace(last, source=Source.REMOTE, transferred=fetched.nbytes)
    return module


def push(cache: Any, ctx: Any) -> Outcome[int] | None:
    """After a save: push this rank's committed entry (read-write remotes only, in the background if asked)."""
    cfg = cache.cfg
    events = cache.events
    lead = _FLIGHTS.pop(cache, None)
    try:
        if not (events and events[-1].kind == EventKind.SAVE):
            return None
        return _push(cache, ctx, cfg, events, leading=lead is not None)
    finally:
        if lead is not None:  # every rank's record went up (or the build failed): followers restore or build
            HeldFlight(lead[0], lead[1]).finish()  # every rank of a leading host calls push() after its save


def _push(cache: Any, ctx: Any, cfg: Any, events: Any, *, leading: bool = False) -> Outcome[int] | None:
    opened = remote_for(getattr(cfg, "remote", None), background=bool(getattr(cfg, "remote_background", False)))
    if opened is None or not opened[0].writable:
        return None
    remote, uploader = opened
    try:
        from adstore.store import remote_save

        out = remote_save(cache.store(), uploader or remote, cache.key(ctx).key, ctx.rank)
        if leading and uploader is not None:  # followers wait for the record: send it before the release
            uploader.flush(wait_seconds())
    except Exception:  # remote_save never raises; a bug must not fail the pipeline either
        log.exception("remote push failed")
        return Outcome(reason="remote_error")
    if not out.ok:
        log.warning("remote push of %s rank %d: %s", events[-1].key, ctx.rank, out.reason)
    return out
