"""Errors of the daemon and the CLI, under the one adstore hierarchy.

They carry data (the pid that holds the lock, the missing feature) so that
the CLI can print one precise line and pick its exit code from the single
table in :mod:`adstore.daemon.cli`.  ``UnknownKey`` and
``AmbiguousKey`` are the store's key-resolution errors, re-exported here.
"""

from __future__ import annotations

from adstore.store.errors import AdstoreError, AmbiguousKey, ConfigError
from adstore.store.errors import KeyNotFound as UnknownKey  # the CLI's name; raised by the store
from adstore.store.reasons import Reason

__all__ = [
    "DaemonError",
    "AlreadyRunning",
    "UnknownKey",
    "AmbiguousKey",
    "FeatureUnavailable",
    "ConfigError",
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
            f"another adstore daemon ({holder}) already manages this store "
            f"(lock {lock_path} is held); stop it first"
        )


class FeatureUnavailable(DaemonError):
    """An optional part (the torch-side demo or snapshot summary) cannot be imported."""

    reason = Reason.UNAVAILABLE

    def __init__(self, feature: str, detail: str) -> None:
        self.feature = feature
        self.detail = detail
        super().__init__(f"{feature} is unavailable: {detail}")
