"""Single-flight for entries a compiler makes on a miss: one host of a fleet compiles, the others wait, then hit.

The pipeline's cache point and compile stage take their build lease through
:func:`~adstore.integration.coordination.remote.stage_flight`; the entries made
inside a compiler (Inductor's FX graphs, ``aot_compile`` artifacts, vLLM's
trees) have no collective and no stage around them, only "look up, miss,
compile, save".  :class:`EntryFlights` puts the same lease
(:class:`~adstore.store.remote.SingleFlight`) around that: after a miss of
``key`` locally and on the remote, :meth:`EntryFlights.after_miss` leads
(compile, save, then :meth:`EntryFlights.built` releases at once) or waits
for the leader's record and says "look again".  A wait is bounded by the
compile time recorded for that kind of entry (4x the mean, at least
:data:`MIN_WAIT`) and never longer than ``ADSTORE_FLIGHT_WAIT`` (default
300 s; the cap alone while nothing is recorded).  A leader renews its lease
(``ADSTORE_FLIGHT_TTL``, default 60 s) from a thread while it compiles; a
leader that dies stops renewing, its lease expires, and exactly one waiter
takes it over (:meth:`SingleFlight.wait` with ``take_over``).

Processes of one host share its store, and each process is its own holder
on the remote: a host's processes and a fleet's hosts are one flight, and a
waiter also stops at its own store's entry (a process next door saved it).
A remote without a conditional create, a read-only remote, a remote that is
down or refusing calls, and a store without a remote: no lease, everyone
compiles as before (said once per process in the log).  Nothing here raises.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from adstore.store import Reason, parse_duration

if TYPE_CHECKING:  # the remote tier loads with the first miss that could take a lease (a store with a remote)
    from adstore.store.remote import Flight, SingleFlight

__all__ = ["EntryFlights", "DEFAULT_WAIT", "DEFAULT_TTL", "MIN_WAIT", "flight_wait_cap", "flight_ttl", "flights_for"]

log = logging.getLogger(__name__)

#: The longest wait for another host's entry unless ``ADSTORE_FLIGHT_WAIT`` says otherwise.
DEFAULT_WAIT = 300.0
#: A lease lasts this long past its holder's last renewal (``ADSTORE_FLIGHT_TTL``): how long a dead builder
#: holds the others up.
DEFAULT_TTL = 60.0
#: The shortest bounded wait however fast that kind of entry compiled before (a loaded builder is slower).
MIN_WAIT = 30.0
#: A wait lasts this many times the mean recorded compile of its kind.
WAIT_FACTOR = 4.0

_said: set[str] = set()
_said_lock = threading.Lock()


def _say_once(reason: str, detail: str) -> None:
    with _said_lock:
        if reason in _said:
            return
        _said.add(reason)
    log.info("adstore: no single-flight lease (%s): %s; every host compiles what it misses", reason, detail)


def _duration(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        return parse_duration(raw, field=name) if raw else default
    except Exception as exc:  # noqa: BLE001 - a bad setting is logged, the default is used
        log.warning("%s; using %.0fs", exc, default)
        return default


def flight_wait_cap() -> float:
    """The longest a waiter waits (``ADSTORE_FLIGHT_WAIT``)."""
    return _duration("ADSTORE_FLIGHT_WAIT", DEFAULT_WAIT)


def flight_ttl() -> float:
    """How long a lease outlives its holder's last renewal (``ADSTORE_FLIGHT_TTL``)."""
    return max(1.0, _duration("ADSTORE_FLIGHT_TTL", DEFAULT_TTL))


_for: weakref.WeakKeyDictionary[Any, EntryFlights] = weakref.WeakKeyDictionary()
_for_lock = threading.Lock()
_everyone: weakref.WeakSet[EntryFlights] = weakref.WeakSet()
_at_exit: list[bool] = []


def flights_for(store: Any) -> EntryFlights:
    """The process's one :class:`EntryFlights` of ``store``: the call that leads and the one that saves meet here."""
    with _for_lock:
        try:
            found = _for.get(store)
            if found is None:
                found = _for[store] = EntryFlights(store, weak=True)
            return found
        except TypeError:  # a store that cannot be weakly referenced: its own, unshared
            return EntryFlights(store)


def _release_everything() -> None:
    """At exit: a lease this process still holds (a compile that never saved) goes before its expiry."""
    for flights in list(_everyone):
        flights.release_all()


class EntryFlights:
    """The leases one store's compiler entries are built under (one per integration object; thread-safe)."""

    def __init__(
        self,
        store: Any,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        settle: float = 0.25,
        weak: bool = False,
    ) -> None:
        """``clock`` times compiles; ``wall``, ``sleep`` and ``settle`` go to :class:`SingleFlight` (tests).

        ``weak``: hold the store weakly (:func:`flights_for`, which keys on
        it, so that a closed store is not kept alive by its flights).
        """
        self._store: Callable[[], Any] = weakref.ref(store) if weak else (lambda: store)
        self._clock = clock
        self._wall, self._sleep, self._settle = wall, sleep, settle
        self._held: dict[str, tuple[SingleFlight, Flight, float]] = {}
        self._lock = threading.Lock()

    @property
    def store(self) -> Any:
        """The store (None once it is gone)."""
        return self._store()

    def _flights(self) -> SingleFlight | None:
        """The remote's lease protocol, or None (said once) where leases are not taken."""
        tier = getattr(self.store, "tier", None)
        if tier is None or os.environ.get("ADSTORE_FLIGHT", "").strip().lower() in ("0", "off", "no", "false"):
            return None
        if getattr(self.store, "read_only", False):  # it could not save what it compiled: it never leads
            _say_once(str(Reason.READ_ONLY), "this host's store is read-only")
            return None
        from adstore.store.remote import ConditionalWrites, SingleFlight

        remote = tier.remote
        if not remote.writable:
            _say_once(str(Reason.REMOTE_READ_ONLY), "this host only reads the remote")
            return None
        if remote.backend.conditional_writes is ConditionalWrites.NONE:
            _say_once(str(Reason.REMOTE_UNSUPPORTED), f"{remote.url} has no conditional create")
            return None
        refused = remote.refusal()
        if refused is not None:
            _say_once(str(refused), f"{remote.url} is not answering")
            return None
        return SingleFlight(remote, clock=self._wall, sleep=self._sleep, settle=self._settle)

    def after_miss(self, key: str, kind: str) -> bool:
        """``key`` (a ``kind`` entry) is neither here nor on the remote: True when it arrived while waiting.

        False: compile here, then call :meth:`built` (this process may hold
        the lease, its own or one taken over from a builder that is gone).
        """
        try:
            flights = self._flights()
            if flights is None:
                return False
            from adstore.store.remote import Role

            ttl = flight_ttl()
            flight = flights.acquire(key, ttl=ttl, heartbeat=ttl / 3)
            if flight.role is Role.SOLO:
                _say_once(str(flight.reason), f"the build lease of {key[:12]} could not be taken")
                return False
            if flight.role is Role.FOLLOWER:
                waited = flights.wait(
                    flight,
                    ready=lambda: self._arrived(flights, key),
                    timeout=self.wait_for(kind),
                    take_over=True,
                    ttl=ttl,
                    heartbeat=ttl / 3,
                )
                if waited.ready:
                    return True
                log.info("single-flight wait for %s %s ended (%s): compiling here", kind, key[:12], waited.reason)
                if waited.flight is None:
                    return False
                flight = waited.flight
            with self._lock:
                self._held[key] = (flights, flight, self._clock())
            _everyone.add(self)
            if not _at_exit:
                _at_exit.append(True)
                atexit.register(_release_everything)
            return False
        except Exception:  # noqa: BLE001 - fail open: the lease only saves work
            log.exception("single-flight for %s not taken", key[:12])
            return False

    def _arrived(self, flights: SingleFlight, key: str) -> bool:
        """The leader's record is on the remote, or a process of this host saved the entry in our store."""
        from adstore.store.remote import Kind, record_address

        tier = getattr(self.store, "tier", None)
        if tier is not None:
            with tier.local_only():
                if self.store.lookup(key, count=False).hit:
                    return True
        return flights.remote.head(Kind.AC, record_address(key, 0)).value is not None

    def built(self, key: str, kind: str) -> None:
        """After the save of ``key`` (pushed by the store's tier) or a failed build: release the lease at once.

        The time from taking the lease to here is recorded for the waits on
        ``kind`` (``remote.flight.compile_ms.<kind>`` and ``.compiles.<kind>``).
        """
        with self._lock:
            held = self._held.pop(key, None)
        if held is None:
            return
        flights, flight, start = held
        try:
            took = self._clock() - start
            self.store.count(
                {f"remote.flight.compile_ms.{kind}": max(1, int(took * 1000)), f"remote.flight.compiles.{kind}": 1}
            )
            flights.release(flight)
        except Exception:  # noqa: BLE001 - an unreleased lease expires
            log.exception("single-flight lease of %s not released", key[:12])

    def release_all(self) -> None:
        """Drop every lease still held (a compile that never saved): its waiters take over or build."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for flights, flight, _ in held:
            try:
                flights.release(flight)
            except Exception:  # noqa: BLE001 - an unreleased lease expires
                log.debug("single-flight lease not released", exc_info=True)

    def wait_for(self, kind: str) -> float:
        """How long a waiter on a ``kind`` entry waits: 4x that kind's mean recorded compile, within the cap."""
        cap = flight_wait_cap()
        try:
            counters = self.store.stats().counters
            ms, n = (
                counters.get(f"remote.flight.compile_ms.{kind}", 0),
                counters.get(f"remote.flight.compiles.{kind}", 0),
            )
        except Exception:  # noqa: BLE001 - no record: the cap
            return cap
        if n <= 0:
            return cap
        return min(cap, max(MIN_WAIT, WAIT_FACTOR * ms / 1000.0 / n))
