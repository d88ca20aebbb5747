"""Leases: a live process pins an entry so gc leaves it alone (invariant 8).

A lease records pid *and* the process start time (psutil), so a pid reused
by another process after the holder died does not keep the entry pinned.
Leases from another host cannot be checked, so they count until they expire
(docs/architecture.md, "How an entry lives").  A published manifest names
its producer the same way, so a save in flight is never cut by gc
(:func:`producer_is_live`).
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
    "producer",
    "producer_is_live",
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


@functools.lru_cache(maxsize=4)
def _start_of(pid: int) -> float:
    return process_start_time(pid)


def producer() -> dict[str, Any]:
    """Who publishes a manifest: host, pid and start time of this process, and its uid."""
    pid = os.getpid()
    return {"host": hostname(), "pid": pid, "start": _start_of(pid), "uid": os.geteuid()}


def producer_is_live(who: Mapping[str, Any]) -> bool:
    """Whether the process that published a manifest (:func:`producer`) still runs: its save is in flight.

    Checked like a lease holder (same pid *and* start time, on this host).
    A producer on another host, or a row that names no start time, cannot be
    checked: False, and the grace period alone decides.
    """
    try:
        host, pid, start = str(who["host"]), int(who["pid"]), float(who["start"])
    except (KeyError, TypeError, ValueError):
        return False
    if host != hostname():
        return False
    if pid == os.getpid():
        return abs(_start_of(pid) - start) < 1e-3
    return holder_is_live(pid, start, host, 0.0, now=0.0)


def new_lease_row(key: str, ttl: float, now: float) -> LeaseRow:
    return LeaseRow(
        key=key, pid=os.getpid(), start_time=process_start_time(), host=hostname(), created=now, expires=now + ttl
    )


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
