"""Leases: a live process pins an entry so gc leaves it alone (invariant 8).

A lease records pid *and* the process start time (psutil), so a pid reused
by another process after the holder died does not keep the entry pinned.
Leases from another host cannot be checked, so they count until they expire
(docs/architecture.md, "How an entry lives").  A published manifest names
its producer the same way, so a save in flight is never cut by gc
(:func:`in_flight`).
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


@functools.lru_cache(maxsize=4)
def _own_start(pid: int) -> float:
    return process_start_time(pid)


def publisher() -> dict[str, Any]:
    """Who publishes a manifest (its ``producer``): host, pid and start time (as a lease's), uid."""
    pid = os.getpid()  # per call: a forked child is another publisher
    return {"host": hostname(), "pid": pid, "start": _own_start(pid), "uid": os.geteuid()}


def in_flight(producer: Mapping[str, Any]) -> bool:
    """Whether the process that published an uncommitted manifest still runs here: its save is in flight.

    A sweep or an eviction never drops such a manifest, whatever the grace
    period: only a writer that died leaves an orphan.  A producer from
    another host, or one recorded without a start time (an older adstore),
    cannot be checked; the grace period alone protects it.
    """
    pid, start, host = producer.get("pid"), producer.get("start"), producer.get("host")
    if type(pid) is not int or not isinstance(start, (int, float)) or host != hostname():
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
