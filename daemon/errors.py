"""Errors of the daemon and the CLI, under the one adstore hierarchy.

They carry data (the pid that holds the lock, the missing feature) so that
the CLI can print one precise line and pick its exit code from the single
table in :mod:`adstore.daemon.cli`.  ``UnknownKey`` and
``AmbiguousKey`` are the store's key-resolution errors, re-exported here.
"""

from __future__ import annotations

from typing import Any

from adstore.store import AdstoreError, AmbiguousKey, ConfigError, Reason
from adstore.store import KeyNotFound as UnknownKey  # the CLI's name; raised by the store

__all__ = [
    "DaemonError",
    "AlreadyRunning",
    "UnknownKey",
    "AmbiguousKey",
    "FeatureUnavailable",
    "UsageError",
    "StillOverBudget",
    "ConfigError",
    "RemoteFailed",
    "LISTING",
    "REMOTE_HINTS",
]


class DaemonError(AdstoreError):
    """Something the daemon or the CLI refused or could not do."""

    reason = Reason.DAEMON_ERROR


class AlreadyRunning(DaemonError):
    """Another daemon holds the store's lock file; only one may enforce a budget."""

    reason = Reason.ALREADY_RUNNING

    def __init__(self, lock_path: str, pid: int | None) -> None:
        self.lock_path = lock_path
        self.pid = pid
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"another adstore daemon ({holder}) already manages this store (lock {lock_path} is held); stop it first"
        )


class FeatureUnavailable(DaemonError):
    """An optional part (the torch-side demo or snapshot summary) cannot be imported."""

    reason = Reason.UNAVAILABLE

    def __init__(self, feature: str, detail: str) -> None:
        self.feature = feature
        self.detail = detail
        super().__init__(f"{feature} is unavailable: {detail}")


class UsageError(DaemonError):
    """The command line is wrong (unknown flag, missing or malformed argument); exit 2 like argparse."""

    reason = Reason.USAGE

    def __init__(self, message: str, *, prog: str = "adstore") -> None:
        self.message = message
        self.prog = prog  # the (sub)command whose arguments were wrong
        super().__init__(message)


class StillOverBudget(DaemonError):
    """``gc`` freed what it could, but the store still misses its limit.

    ``over`` is the bytes still above ``limit``; ``blocked`` maps what kept
    entries (``pinned``, ``leased``, ``grace_period``) to their keys.  With no
    such entry, what is left is unreferenced blobs inside the grace period
    (a later sweep frees them), or, when the whole store (``store_bytes``) is
    less than ``over``, other files filling the filesystem.  ``details`` is
    all of it (for ``--json``).
    """

    reason = Reason.OVER_BUDGET
    _LABELS = {"pinned": "pinned", "leased": "leased", "grace_period": "inside the grace period"}

    def __init__(
        self,
        *,
        over: int,
        limit: str,
        blocked: dict[str, list[str]],
        store_bytes: int,
        details: dict[str, Any] | None = None,
    ) -> None:
        from adstore.store import human_size

        self.over = over
        self.limit = limit
        self.blocked = blocked
        self.store_bytes = store_bytes
        self.details = {
            "over_bytes": over,
            "limit": limit,
            "blocked": blocked,
            "store_bytes": store_bytes,
            **(details or {}),
        }
        parts = [
            f"{len(keys)} {'entry' if len(keys) == 1 else 'entries'} {self._LABELS.get(what, what)}"
            f" ({', '.join(k[:12] for k in keys[:3])}{', …' if len(keys) > 3 else ''})"
            for what, keys in blocked.items()
            if keys
        ]
        reasons = []
        if over > store_bytes:
            reasons.append(f"the whole store is {human_size(store_bytes)}, other files fill the filesystem")
        if parts:
            reasons.append("kept by " + ", ".join(parts))
        hows = [self._HOWS[what] for what, keys in blocked.items() if keys and what in self._HOWS]
        if not parts:
            reasons.append(
                "kept by unreferenced blobs inside the grace period (a later sweep frees them) or by saves in flight"
            )
            hows.append(self._HOWS["grace_period"])
        why = "; ".join(reasons)
        amount = human_size(over) + (f" ({over} bytes)" if over >= 1024 else "")
        super().__init__(f"still {amount} over {limit}: {why}" + "".join(f"; {how}" for how in hows))

    #: What frees each kind of kept bytes: the end of the error line.
    _HOWS = {
        "grace_period": "--grace-period 0 frees what is younger now (a process that just saved may still read it)",
        "pinned": "`adstore unpin KEY` releases a pinned entry",
        "leased": "a leased entry is in use by a running process until it ends or its lease expires",
    }


class RemoteFailed(DaemonError):
    """``push`` or ``pull`` could not transfer some keys; ``failures`` lists them with their reasons.

    The reason is the first failure's (``remote_unavailable``,
    ``untrusted_remote``, ``absent``...); ``details`` is every result (for
    ``--json``).  Every key was tried before this is raised.
    """

    reason = Reason.REMOTE_ERROR

    def __init__(self, verb: str, failures: list[dict[str, Any]], *, details: dict[str, Any] | None = None) -> None:
        self.failures = failures
        self.details = details or {"results": failures}
        first = failures[0]
        try:
            self.reason = Reason(first["reason"])
        except ValueError:
            pass
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        where = "to list the remote" if first["key"] == LISTING else f"for {first['key'][:16]} rank {first['rank']}"
        hint = REMOTE_HINTS.get(str(first["reason"]))
        super().__init__(f"{verb} failed {where}: {first['reason']}{more}" + (f"; {hint}" if hint else ""))


#: The key of a failure to list the remote's records (``pull --all``), which is no entry's.
LISTING = "(listing)"

#: What to do about a transfer's reason: the line a user reads ends with it.
REMOTE_HINTS: dict[str, str] = {
    str(Reason.UNTRUSTED_REMOTE): "records are loaded only when signed by a key in ADSTORE_TRUSTED_KEYS "
    "(the builders' .pub file, from adstore keygen); `adstore remote` shows the keys trusted here",
    str(Reason.REMOTE_UNAVAILABLE): "`adstore remote` probes the server (--remote URL or ADSTORE_REMOTE)",
    str(Reason.REMOTE_UNSUPPORTED): "listing needs a WebDAV or S3 remote; give the KEYs instead",
}
