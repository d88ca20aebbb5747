"""The pipeline cache's remote tier: restore a local miss from the remote, push a save to it.

The pipeline cache calls :func:`prefetch` before its own restore and
:func:`push` after a save; both are no-ops without a remote (the
``remote`` setting of ``pipeline_cache``, else ``ADSTORE_REMOTE`` read when
the pipeline runs).  A prefetch that restores commits this rank's record in
the local store, so the cache's ordinary restore (lookup, rank agreement,
load) then finds it: ranks still agree through the collectives and each
rank restores only its own record.  :func:`mark` relabels that hit's event
``source="remote"`` with the bytes transferred.  A read-write process that
finds no record takes a single-flight build lease (one process, world size
1): the leader builds and pushes, then releases; followers wait a bounded
time (``ADSTORE_REMOTE_WAIT``, default 300 s) for its record and restore
it, or build themselves when the wait ends or the builder is gone.  Everything fails open:
the remote can turn a miss into a hit, never a hit into a failure (README,
"Remote tier").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import weakref
from typing import Any

from adstore.integration.pipeline.events import EventKind, Source
from adstore.store.reasons import Reason
from adstore.store.remote import (
    BackgroundUploader,
    Flight,
    Outcome,
    Remote,
    RemoteConfig,
    SingleFlight,
    record_address,
)
from adstore.store.units import parse_duration
from adstore.store.tiered import remote_restore, remote_save

__all__ = ["remote_for", "prefetch", "mark", "push"]

log = logging.getLogger(__name__)

#: Seconds a follower waits for a single-flight leader's record before building itself.
DEFAULT_FLIGHT_WAIT = 300.0

_FLIGHTS: weakref.WeakKeyDictionary[Any, tuple[SingleFlight, Flight]] = weakref.WeakKeyDictionary()
_OPEN: dict[str, tuple[Remote, BackgroundUploader | None]] = {}
_OPEN_LOCK = threading.Lock()


def remote_for(url: str | None, *, background: bool = False) -> tuple[Remote, BackgroundUploader | None] | None:
    """The process's one :class:`Remote` for ``url`` (or ``ADSTORE_REMOTE``), None without one.

    One per configuration, so its circuit breaker spans every pipeline of
    the process; a configuration that cannot be opened (bad key file,
    unknown scheme) is logged once per call and means "no remote".
    """
    try:
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
    returns the remote outcome, or None when the remote was not asked.
    """
    cfg = cache.cfg
    if not (cfg.enabled and cfg.restore):
        return None
    opened = remote_for(getattr(cfg, "remote", None))
    if opened is None:
        return None
    try:
        key = cache.key(ctx).key
        store = cache.store()
        if store.lookup(key, rank=ctx.rank, record=False).hit:
            return None
    except Exception as exc:  # the cache's own restore reports this failure
        log.debug("remote prefetch skipped: %s", exc)
        return None
    remote = opened[0]
    out = remote_restore(store, remote, key, ctx.rank, ctx.world_size)
    if out.reason != Reason.ABSENT or not remote.writable or ctx.world_size != 1:
        return out
    return _single_flight(cache, store, remote, key, out)


def _single_flight(cache: Any, store: Any, remote: Remote, key: str, missed: Outcome[Any]) -> Outcome[Any]:
    """No record anywhere: lead the build (remembered for :func:`push`) or wait for the leader's record."""
    flights = SingleFlight(remote)
    flight = flights.acquire(key)
    if flight.leader:
        _FLIGHTS[cache] = (flights, flight)
        return missed
    if flight.role != "follower":
        return missed
    raw = os.environ.get("ADSTORE_REMOTE_WAIT", "").strip()
    try:
        wait = parse_duration(raw, field="ADSTORE_REMOTE_WAIT") if raw else DEFAULT_FLIGHT_WAIT
    except Exception as exc:
        log.warning("%s; waiting %.0fs", exc, DEFAULT_FLIGHT_WAIT)
        wait = DEFAULT_FLIGHT_WAIT
    address = record_address(key, 0)
    waited = flights.wait(flight, ready=lambda: remote.head("ac", address).value is not None, timeout=wait)
    if not waited.ready:
        log.info("single-flight wait for %s ended (%s): building here", key, waited.reason)
        return missed
    return remote_restore(store, remote, key, 0, 1)


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
        return _push(cache, ctx, cfg, events)
    finally:
        if lead is not None:  # after the record went up (or the build failed): followers restore or build
            lead[0].release(lead[1])


def _push(cache: Any, ctx: Any, cfg: Any, events: Any) -> Outcome[int] | None:
    opened = remote_for(getattr(cfg, "remote", None), background=bool(getattr(cfg, "remote_background", False)))
    if opened is None or not opened[0].writable:
        return None
    remote, uploader = opened
    try:
        out = remote_save(cache.store(), uploader or remote, cache.key(ctx).key, ctx.rank)
    except Exception:  # remote_save never raises; a bug must not fail the pipeline either
        log.exception("remote push failed")
        return Outcome(reason="remote_error")
    if not out.ok:
        log.warning("remote push of %s rank %d: %s", events[-1].key, ctx.rank, out.reason)
    return out
