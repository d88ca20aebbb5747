"""Download reservations: bytes an admission let in and nobody has written yet, seen by every process.

Why: a restore is admitted against the budget and the free space before
its first byte, and two ranks restoring at once would each see the same
room and together overrun it.  So the admission writes what it admits into
the index (a ``meta`` row ``reservation/<id>``) in the write transaction
that checks, and every admission counts the live reservations of the
others.  A reservation shrinks as its blobs land (from then on they count
as the store's size and the disk's use) and goes when the download ends,
whether it succeeded or not (docs/remote.md, "Failure costs").

A process that dies holding one cannot release it: its row stops counting
once the holder (pid *and* start time, as for leases) is gone, or once it
expires on the store's clock, and the next admission deletes it.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

from ..index.rows import decode_json, encode_json
from ..index.tables import Tables, Txn
from ..leases import holder_is_live, hostname, process_start_time

__all__ = ["Reservation", "ReservationRow", "reserved", "new_reservation", "RESERVATION_PREFIX", "RESERVATION_TTL"]

log = logging.getLogger(__name__)

#: The names of reservation rows in the ``meta`` table.
RESERVATION_PREFIX = b"reservation/"
#: When a reservation stops counting even if its holder cannot be checked (another host's): a day.
RESERVATION_TTL = 86400.0


@dataclass(frozen=True, slots=True)
class ReservationRow:
    """Bytes one process admitted and has not written yet, and who holds them."""

    nbytes: int
    pid: int
    start_time: float
    host: str
    created: float
    expires: float

    def encode(self) -> bytes:
        return encode_json(asdict(self))

    @classmethod
    def decode(cls, name: bytes, raw: bytes) -> ReservationRow:
        obj = decode_json(raw, "meta", name)
        return cls(
            int(obj["nbytes"]),
            int(obj["pid"]),
            float(obj["start_time"]),
            str(obj["host"]),
            float(obj["created"]),
            float(obj["expires"]),
        )

    def live(self, now: float) -> bool:
        return self.nbytes > 0 and holder_is_live(self.pid, self.start_time, self.host, self.expires, now=now)


def _rows(t: Txn) -> Iterator[tuple[bytes, ReservationRow | None]]:
    for name, raw in t.meta_items(RESERVATION_PREFIX):
        try:
            yield name, ReservationRow.decode(name, raw)
        except Exception:  # a damaged row reserves nothing
            yield name, None


def reserved(t: Txn, now: float) -> tuple[int, list[bytes]]:
    """(bytes the live reservations hold, names of the dead or damaged ones)."""
    live, dead = 0, []
    for name, row in _rows(t):
        if row is not None and row.live(now):
            live += row.nbytes
        else:
            dead.append(name)
    return live, dead


def new_reservation(t: Txn, nbytes: int, now: float) -> bytes:
    """Write a reservation of ``nbytes`` for this process in ``t``; its row's name."""
    name = RESERVATION_PREFIX + f"{os.getpid()}.{uuid.uuid4().hex}".encode()
    row = ReservationRow(nbytes, os.getpid(), process_start_time(), hostname(), now, now + RESERVATION_TTL)
    t.put_meta(name, row.encode())
    return name


class Reservation:
    """An admitted download's hold on the store: :meth:`consume` as its blobs land, :meth:`release` at its end."""

    def __init__(self, tables: Tables | None, name: bytes | None, nbytes: int) -> None:
        self._tables = tables
        self._name = name
        self.remaining = nbytes

    def consume(self, nbytes: int) -> None:
        """``nbytes`` of it were written (and now count as the store's): hold that much less."""
        self._hold(max(0, self.remaining - nbytes))

    def release(self) -> None:
        """The download ended (done or failed): hold nothing (idempotent)."""
        self._hold(0)

    def _hold(self, nbytes: int) -> None:
        if self._tables is None or self._name is None or nbytes == self.remaining:
            return
        name = self._name

        def update(t: Txn) -> None:
            raw = t.meta(name)
            if raw is None:
                return
            if nbytes == 0:
                t.drop_meta(name)
            else:
                t.put_meta(name, replace(ReservationRow.decode(name, raw), nbytes=nbytes).encode())

        try:
            self._tables.write(update)
        except Exception as exc:  # the row then lapses with this process, or at its expiry
            log.warning("could not update the download reservation %s: %s", name.decode(errors="replace"), exc)
        self.remaining = nbytes

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
