"""The systemd notify protocol (``sd_notify``) without a dependency.

systemd passes ``$NOTIFY_SOCKET`` to a ``Type=notify`` service: a path or an
abstract socket name written with a leading ``@``.  The service sends
newline-separated ``KEY=value`` datagrams (``READY=1``, ``STATUS=…``,
``WATCHDOG=1``, ``RELOADING=1``, ``STOPPING=1``).  Outside systemd there is no
socket and every call is a cheap no-op, so the daemon code never branches on
whether it runs under systemd.

``$WATCHDOG_USEC`` (with ``$WATCHDOG_PID`` naming the process it is meant
for) asks for a ``WATCHDOG=1`` at least that often; the daemon pings at half
of it, as sd_watchdog_enabled(3) recommends.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

from adstore.store import ConfigError, parse_count

__all__ = ["Notifier", "watchdog_interval"]

log = logging.getLogger(__name__)


def watchdog_interval(environ: Mapping[str, str] | None = None, *, pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``$WATCHDOG_USEC``), or None if not asked."""
    env = os.environ if environ is None else environ
    raw = env.get("WATCHDOG_USEC")
    if not raw:
        return None
    target_pid = env.get("WATCHDOG_PID")
    if target_pid:
        try:
            if parse_count(target_pid, field="WATCHDOG_PID") != (os.getpid() if pid is None else pid):
                return None
        except ConfigError:
            log.warning("ignoring malformed WATCHDOG_PID=%r", target_pid)
            return None
    try:
        usec = parse_count(raw, field="WATCHDOG_USEC")
    except ConfigError:
        log.warning("ignoring malformed WATCHDOG_USEC=%r", raw)
        return None
    if usec <= 0:
        return None
    return usec / 2_000_000.0


class Notifier:
    """Sends sd_notify datagrams to ``address`` (None: every call is a no-op).

    Sends never block and errors are logged, never raised: a supervisor that
    stopped reading or went away must not stall or take the daemon down.
    """

    def __init__(self, *, address: str | None) -> None:
        self.address = address or None
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        return cls(address=env.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def _target(self) -> str | bytes:
        assert self.address is not None
        if self.address.startswith("@"):
            return b"\0" + self.address[1:].encode()
        return self.address

    def send(self, **fields: object) -> bool:
        """Send ``KEY=value`` lines in one datagram; returns whether it was delivered."""
        if self.address is None:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value).replace("\n", " ")
            lines.append(f"{key.upper()}={text}")
        payload = "\n".join(lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block: a supervisor that stopped reading must not stall eviction.
            self._sock.sendto(payload, socket.MSG_DONTWAIT, self._target())
            return True
        except BlockingIOError:
            log.debug("sd_notify queue of %s is full; dropped %s", self.address, payload[:60])
            return False
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self.address, exc)
            self.close()
            return False

    def ready(self, status: str | None = None) -> bool:
        fields: dict[str, object] = {"READY": 1, "MAINPID": os.getpid()}
        if status:
            fields["STATUS"] = status
        return self.send(**fields)

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload (systemd >= 253) match the reload.
        return self.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str | None = None) -> bool:
        fields: dict[str, object] = {"STOPPING": 1}
        if status:
            fields["STATUS"] = status
        return self.send(**fields)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
