"""Single-flight builds: when many hosts start the same cold key, one builds.

The leader holds a build lease, an object at ``ac/<sha256("lease:"+key)>``
holding who builds (host, pid, process start time, a random nonce) and until
when; it is created with the remote's put-if-absent (S3 ``If-None-Match:
*``).  Followers poll, with backoff and a bounded wait, for the leader's
record; when the lease expires, its holder's process is gone (checked on the
holder's own host), it is released without a record, or the wait times out,
they build themselves: the lease saves work, it is never needed for a
correct result (docs/remote.md, "Single-flight cold starts").

Servers whose conditional write checks and writes in two steps (wsgidav,
moto) can let two racers both "create" the lease, so a winner reads the
lease back after a short settle time and leads only if it still holds its
own nonce; where the server may ignore ``If-None-Match`` altogether (an
HTTP cache such as bazel-remote), an acquirer also looks for a live lease
before writing.  On a backend without put-if-absent the lease is written with a
plain PUT after looking for a live one, then confirmed the same way: a
best-effort lease, and in the worst case two hosts build the same key.
Leases are not signed: a hostile writer can make followers wait, never for
longer than their wait, and never make them restore anything unsigned.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import psutil

from ..reasons import Reason
from .addresses import Kind, lease_address
from .backend import ConditionalWrites
from .outcomes import Outcome
from .signing import canonical_json

if TYPE_CHECKING:  # a lease role or flight is named by processes that never open a remote
    from .client import Remote

__all__ = ["Role", "Holder", "Lease", "Flight", "WaitResult", "SingleFlight", "DEFAULT_TTL"]

log = logging.getLogger(__name__)

#: Seconds a lease lasts unless renewed: longer than a cold build, short enough that a dead builder is noticed.
DEFAULT_TTL = 600.0


class Role(enum.StrEnum):
    LEADER = "leader"  # build, publish, then release the lease
    FOLLOWER = "follower"  # wait() for the leader's record
    SOLO = "solo"  # build without a lease; the flight's reason says why


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lease: a process on a host, and a nonce unique to this acquisition."""

    host: str
    pid: int
    start_time: float
    nonce: str

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, psutil.Process(pid).create_time(), uuid.uuid4().hex)

    def alive(self) -> bool:
        """False only when provably dead: on this host, the pid is gone or is another process."""
        if self.host != socket.gethostname():
            return True
        try:
            proc = psutil.Process(self.pid)
            return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - self.start_time) < 1e-3
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        except psutil.AccessDenied:
            return True


@dataclass(frozen=True, slots=True)
class Lease:
    key: str
    holder: Holder
    created: float
    expires: float

    def encode(self) -> bytes:
        h = self.holder
        return canonical_json(
            {
                "v": 1,
                "key": self.key,
                "host": h.host,
                "pid": h.pid,
                "start_time": h.start_time,
                "nonce": h.nonce,
                "created": self.created,
                "expires": self.expires,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> Lease | None:
        """The lease, or None for bytes that are not one (treated as a dead lease)."""
        try:
            obj = json.loads(raw)
            holder = Holder(str(obj["host"]), int(obj["pid"]), float(obj["start_time"]), str(obj["nonce"]))
            return cls(str(obj["key"]), holder, float(obj["created"]), float(obj["expires"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
            return None


@dataclass(slots=True)
class Flight:
    """The result of :meth:`SingleFlight.acquire`: this process's role for ``key``."""

    key: str
    role: Role
    reason: str | None = None  # why SOLO (or how a follower got its role)
    lease: Lease | None = None  # ours when leading, the leader's when following
    _stop: threading.Event | None = field(default=None, repr=False)

    @property
    def leader(self) -> bool:
        return self.role is Role.LEADER


@dataclass(frozen=True, slots=True)
class WaitResult:
    """A follower's wait: ``ready`` (restore from the remote) or a reason to build itself."""

    ready: bool
    reason: str | None
    seconds: float
    #: A lease this follower took over from a builder that is gone (``wait(take_over=True)``): build, then release.
    flight: Flight | None = None


class SingleFlight:
    """Build leases on a :class:`Remote` (which enforces read-only mode and the breaker)."""

    def __init__(
        self,
        remote: Remote,
        *,
        settle: float = 0.25,
        poll_min: float = 0.05,
        poll_max: float = 1.0,
        clock_skew: float = 5.0,
        garbage_grace: float = 2.0,
        attempts: int = 3,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.remote = remote
        self.settle = settle
        self.poll_min = poll_min
        self.poll_max = poll_max
        self.clock_skew = clock_skew
        self.garbage_grace = garbage_grace
        self.attempts = attempts
        self._clock = clock
        self._sleep = sleep

    # -- leases on the remote ---------------------------------------------
    def _read(self, key: str) -> tuple[Outcome[bytes], Lease | None]:
        """The lease object and its decoding (None if absent or undecodable).

        A lease that does not decode is read again, with backoff, for up to
        ``garbage_grace`` seconds: a server that writes in place (WebDAV) can
        serve a lease a racing acquirer has truncated but not yet written,
        for as long as a loaded host keeps that writer descheduled.  Still
        undecodable after that, it counts as dead.
        """
        deadline, delay = self._clock() + self.garbage_grace, self.poll_min
        while True:
            got = self.remote.get(Kind.AC, lease_address(key))
            if not got.ok or got.value is None:
                return got, None
            lease = Lease.decode(got.value)
            if lease is not None or self._clock() >= deadline:
                return got, lease
            self._sleep(delay)
            delay = min(delay * 2, self.poll_max)

    def _live(self, lease: Lease | None) -> bool:
        return lease is not None and self._clock() <= lease.expires + self.clock_skew and lease.holder.alive()

    def _new_lease(self, key: str, ttl: float) -> Lease:
        now = self._clock()
        return Lease(key, Holder.me(), now, now + ttl)

    def _flight(self, key: str, role: Role, reason: str | None = None, lease: Lease | None = None) -> Flight:
        self.remote.count(f"flight.{role.value}")
        return Flight(key, role, reason, lease)

    def _confirm(self, mine: Lease) -> Flight:
        """After writing our lease: still ours once racing writes have landed?"""
        if self.settle > 0:
            self._sleep(self.settle)
        got, current = self._read(mine.key)
        if got.ok and current is not None and current.holder.nonce != mine.holder.nonce:
            return self._flight(mine.key, Role.FOLLOWER, "lost_race", current)
        return self._flight(mine.key, Role.LEADER, lease=mine)  # ours, or unreadable: lead (fail open)

    # -- the protocol ------------------------------------------------------
    def acquire(
        self, key: str, *, ttl: float = DEFAULT_TTL, heartbeat: float | None = None, taking_over: bool = False
    ) -> Flight:
        """Lead, follow or go solo for ``key``; never raises.

        A read-only client never writes a lease: it follows a live one or
        goes solo.  ``heartbeat`` (seconds) renews a leader's lease from a
        thread until :meth:`release`, so ``ttl`` can stay short while a
        build runs long.  ``taking_over``: the caller saw the last holder
        gone, so leading is a takeover (``flight.takeovers``) even when
        another waiter removed the dead lease first.
        """
        if not self.remote.writable:
            return self._look(key) or self._flight(key, Role.SOLO, str(Reason.REMOTE_READ_ONLY))
        # A server that may ignore If-None-Match (bazel-remote) would let every acquirer overwrite
        # a live lease: look first there.  Racing writers are then settled by _confirm.
        careful = self.remote.backend.conditional_writes is not ConditionalWrites.ATOMIC
        stale = taking_over  # a dead lease was seen (or removed on the way): leading then is a takeover
        for _ in range(self.attempts):
            if careful and (seen := self._look(key)) is not None:
                return seen
            mine = self._new_lease(key, ttl)
            put = self.remote.put_if_absent(Kind.AC, lease_address(key), mine.encode())
            if put.reason == Reason.REMOTE_UNSUPPORTED:  # best effort: a plain PUT, confirmed
                if not careful and (seen := self._look(key)) is not None:
                    return seen
                written = self.remote.put(Kind.AC, lease_address(key), mine.encode())
                if not written.ok:
                    return self._flight(key, Role.SOLO, written.reason)
                return self._start(self._confirm(mine), heartbeat, stale)
            if not put.ok:
                return self._flight(key, Role.SOLO, put.reason)
            if put.value:
                return self._start(self._confirm(mine), heartbeat, stale)
            got, current = self._read(key)
            if not got.ok:
                return self._flight(key, Role.SOLO, got.reason)
            if got.value is None:
                continue  # released between our write and our read: try again
            if self._live(current):
                return self._flight(key, Role.FOLLOWER, lease=current)
            log.info(
                "remote build lease of %s is stale (%s); taking it over",
                key,
                "undecodable" if current is None else f"held by {current.holder.host}:{current.holder.pid}",
            )
            stale = True
            self.remote.delete(Kind.AC, lease_address(key))
        return self._flight(key, Role.SOLO, str(Reason.BUILDER_GONE))

    def _look(self, key: str) -> Flight | None:
        """Follow a live lease (or go solo on a failing remote); None when there is no live lease."""
        got, current = self._read(key)
        if not got.ok:
            return self._flight(key, Role.SOLO, got.reason)
        if self._live(current):
            return self._flight(key, Role.FOLLOWER, lease=current)
        return None

    def _start(self, flight: Flight, heartbeat: float | None, stale: bool = False) -> Flight:
        if flight.leader and stale:  # counted once per takeover, by the one acquirer that won it
            self.remote.count("flight.takeovers")
        if flight.leader and heartbeat:
            flight._stop = threading.Event()
            threading.Thread(
                target=self._beat, args=(flight, heartbeat), daemon=True, name=f"adstore-lease-{flight.key[:12]}"
            ).start()
        return flight

    def _beat(self, flight: Flight, interval: float) -> None:
        assert flight._stop is not None and flight.lease is not None
        ttl = flight.lease.expires - flight.lease.created
        while not flight._stop.wait(interval):
            self.renew(flight, ttl=ttl)

    def renew(self, flight: Flight, *, ttl: float = DEFAULT_TTL) -> bool:
        """Push a leader's expiry to now + ``ttl`` (a build that runs long)."""
        if not flight.leader or flight.lease is None:
            return False
        now = self._clock()
        renewed = replace(flight.lease, expires=now + ttl)
        ok = self.remote.put(Kind.AC, lease_address(flight.key), renewed.encode()).ok
        if ok:
            flight.lease = renewed
        return ok

    def release(self, flight: Flight) -> bool:
        """Drop a leader's lease (after publishing, or after failing: followers then build)."""
        if flight._stop is not None:
            flight._stop.set()
        if not flight.leader or flight.lease is None:
            return False
        got, current = self._read(flight.key)
        if got.ok and current is not None and current.holder.nonce != flight.lease.holder.nonce:
            return False  # taken over after it expired: not ours to delete
        return self.remote.delete(Kind.AC, lease_address(flight.key)).ok

    def wait(
        self,
        flight: Flight,
        *,
        ready: Callable[[], bool],
        timeout: float,
        take_over: bool = False,
        ttl: float = DEFAULT_TTL,
        heartbeat: float | None = None,
    ) -> WaitResult:
        """Follow: poll ``ready()`` (the leader's record is on the remote) for at most ``timeout`` s.

        When the leader is gone without its record (its lease expired, its
        process died, it released after a failed build), every follower
        builds, unless ``take_over``: then each tries to take the lease over
        (:meth:`acquire`, ``ttl`` and ``heartbeat`` as there), so exactly one
        leads (the result's ``flight``) and the rest follow the new lease,
        within the same deadline.  The time waited is counted
        (``flight.waited_ms``), once per wait.
        """
        start = self._clock()
        deadline, delay = start + timeout, self.poll_min
        if flight.role is not Role.FOLLOWER:  # a leader builds, a solo flight builds: nothing to wait for
            return WaitResult(False, flight.reason, 0.0)

        def done(ok: bool, reason: str | None, lead: Flight | None = None) -> WaitResult:
            seconds = self._clock() - start
            self.remote.count("flight.ready" if ok else f"flight.{reason}")
            self.remote.count("flight.waits")
            self.remote.count("flight.waited_ms", max(1, int(seconds * 1000)))
            return WaitResult(ok, reason, seconds, lead)

        while True:
            if _safely(ready):
                return done(True, None)
            now = self._clock()
            if now >= deadline:
                return done(False, str(Reason.SINGLE_FLIGHT_TIMEOUT))
            got, current = self._read(flight.key)
            if not got.ok:
                return done(False, got.reason)
            if not self._live(current):  # released, expired or dead: one last look for its record
                if _safely(ready):
                    return done(True, None)
                if not take_over:
                    return done(False, str(Reason.BUILDER_GONE))
                again = self.acquire(flight.key, ttl=ttl, heartbeat=heartbeat, taking_over=True)
                if again.role is Role.LEADER:
                    return done(False, str(Reason.BUILDER_GONE), again)
                if again.role is Role.SOLO:
                    return done(False, again.reason)
                flight, delay = again, self.poll_min  # another waiter took it over: follow that one
                continue
            self._sleep(max(0.0, min(delay, deadline - now)))
            delay = min(delay * 2, self.poll_max)


def _safely(ready: Callable[[], bool]) -> bool:
    try:
        return bool(ready())
    except Exception:  # a failing check is "not yet", never an error for the pipeline
        log.debug("single-flight readiness check failed", exc_info=True)
        return False
