"""Leases: a live process pins an entry so gc leaves it alone (invariant 8).

A lease records pid *and* the process start time (psutil), so a pid reused
by another process after the holder died does not keep the entry pinned.
Leases from another host cannot be checked, so they count until they expire
(docs/architecture.md, "How an entry lives").  A published manifest names
its producer the same way, so a save in flight is not cut by gc
(:func:`in_flight`) until its publish deadline: a publisher that lives on
without committing (a server stuck after a failed abort) does not hold its
blobs past the budget for as long as it runs.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Mapping
from typing import Any

import psutil

from .index.rows import LeaseRow
from .index.tables import Txn

__all__ = [
    "DEFAULT_PUBLISH_TIMEOUT",
    "process_start_time",
    "lease_is_live",
    "holder_is_live",
    "hostname",
    "new_lease_row",
    "live_leases",
    "publisher",
    "in_flight",
]


@functools.lru_cache(maxsize=1)
def hostname() -> str:
    return socket.gethostname()


def process_start_time(pid: int | None = None) -> float:
    return psutil.Process(pid if pid is not None else os.getpid()).create_time()


def lease_is_live(lease: LeaseRow, *, now: float) -> bool:
    """True while the holder process (same pid and start time) still runs, and ``now`` is before expiry."""
    return holder_is_live(lease.pid, lease.start_time, lease.host, lease.expires, now=now)


def holder_is_live(pid: int, start_time: float, host: str, expires: float, *, now: float) -> bool:
    """Whether what a process holds (a lease, a download reservation) still counts.

    Until ``expires`` (0: never), while the process with this pid *and*
    start time runs; a holder on another host cannot be checked, so it
    counts until it expires.
    """
    if expires and now > expires:
        return False
    if host != hostname():
        return True
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return abs(proc.create_time() - start_time) < 1e-3
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def new_lease_row(key: str, ttl: float, now: float) -> LeaseRow:
    return LeaseRow(
        key=key, pid=os.getpid(), start_time=process_start_time(), host=hostname(), created=now, expires=now + ttl
    )


#: Seconds a live publisher's uncommitted manifest is kept from gc by default (``Store(publish_timeout=...)``,
#: ``ADSTORE_PUBLISH_TIMEOUT``); the grace period still applies when it is longer.
DEFAULT_PUBLISH_TIMEOUT = 3600.0


@functools.lru_cache(maxsize=4)
def _own_start(pid: int) -> float:
    return process_start_time(pid)


def publisher(until: float) -> dict[str, Any]:
    """Who publishes a manifest (its ``producer``): host, pid and start time (as a lease's), uid, and ``until``,
    the publish deadline past which gc no longer waits for its commit (:func:`in_flight`)."""
    pid = os.getpid()  # per call: a forked child is another publisher
    return {"host": hostname(), "pid": pid, "start": _own_start(pid), "uid": os.geteuid(), "until": until}


def in_flight(producer: Mapping[str, Any], created: float, now: float) -> bool:
    """Whether an uncommitted manifest published at ``created`` is a save in flight at ``now``: its publisher
    still runs here, and its publish deadline has not passed.

    A sweep or an eviction does not drop such a manifest, whatever the grace
    period.  The deadline (``until``: publish time + the publisher's
    ``publish_timeout``; ``created`` + :data:`DEFAULT_PUBLISH_TIMEOUT` for a
    row without one) bounds that: past it the manifest is swept like a dead
    writer's, and a later commit raises ``ManifestGone``.  A producer from
    another host, or one recorded without a start time (an older adstore),
    cannot be checked; the grace period alone protects it.
    """
    pid, start, host, until = (producer.get(f) for f in ("pid", "start", "host", "until"))
    if not isinstance(until, (int, float)) or isinstance(until, bool):
        until = created + DEFAULT_PUBLISH_TIMEOUT
    if now >= until or type(pid) is not int or not isinstance(start, (int, float)) or host != hostname():
        return False
    return holder_is_live(pid, float(start), host, 0.0, now=0.0)


def live_leases(t: Txn, now: float) -> tuple[set[str], list[bytes]]:
    """(keys leased by a live process, ids of dead or undecodable leases)."""
    live: set[str] = set()
    dead: list[bytes] = []
    for lease_id, lease in t.leases():
        if lease is not None and lease_is_live(lease, now=now):
            live.add(lease.key)
        else:
            dead.append(lease_id)
    return live, dead
