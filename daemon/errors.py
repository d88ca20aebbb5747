"""Errors of the daemon and the CLI, under the one adstore hierarchy.

They carry data (the key prefix and its candidates, the pid that holds the
lock) so that the CLI can print one precise line and pick its exit code from
the single table in :mod:`adstore.daemon.cli`.
"""

from __future__ import annotations

from collections.abc import Sequence

from adstore.store.errors import AdstoreError, ConfigError

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

    reason = "daemon_error"


class AlreadyRunning(DaemonError):
    """Another daemon holds the store's lock file; only one may enforce a budget."""

    reason = "already_running"

    def __init__(self, lock_path: str, pid: int | None) -> None:
        self.lock_path = lock_path
        self.pid = pid
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"another adstore daemon ({holder}) already manages this store "
            f"(lock {lock_path} is held); stop it first"
        )


class UnknownKey(DaemonError, KeyError):
    """No entry's key equals or starts with what the user typed."""

    reason = "unknown_key"

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        super().__init__(prefix)

    def __str__(self) -> str:  # KeyError would repr() the argument
        return f"no entry matches key {self.prefix!r}"


class AmbiguousKey(DaemonError, KeyError):
    """A key prefix matches more than one entry (like an ambiguous git hash)."""

    reason = "ambiguous_key"

    def __init__(self, prefix: str, candidates: Sequence[str]) -> None:
        self.prefix = prefix
        self.candidates = list(candidates)
        super().__init__(prefix)

    def __str__(self) -> str:
        shown = ", ".join(c[:16] for c in self.candidates[:5])
        more = f" and {len(self.candidates) - 5} more" if len(self.candidates) > 5 else ""
        return (
            f"key prefix {self.prefix!r} is ambiguous: it matches {len(self.candidates)} "
            f"entries ({shown}{more}); type more characters"
        )


class FeatureUnavailable(DaemonError):
    """An optional part (the torch-side demo or snapshot summary) cannot be imported."""

    reason = "unavailable"

    def __init__(self, feature: str, detail: str) -> None:
        self.feature = feature
        self.detail = detail
        super().__init__(f"{feature} is unavailable: {detail}")
