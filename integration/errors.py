"""Errors of the torch-side integration, under the one adstore hierarchy.

``reason`` on each class is the named reason of the miss or bypass that the
cache reports when it catches the error (the cache fails open).
"""

from __future__ import annotations

from adstore.store.errors import AdstoreError, ConfigError

__all__ = [
    "IntegrationError",
    "SnapshotError",
    "UnsupportedModule",
    "UnsupportedHook",
    "ForwardHookPresent",
    "MaterializedParameters",
    "UntrustedTarget",
    "CorruptSnapshot",
    "CacheKeyError",
    "RankDisagreement",
    "EngineCacheError",
    "CorruptEngine",
    "TruncatedEngine",
    "EngineMismatch",
    "EngineUnavailable",
    "UntrustedEngine",
    "ConfigError",
]


class IntegrationError(AdstoreError):
    reason = "integration_error"


class SnapshotError(IntegrationError):
    """A module cannot be snapshotted or a snapshot cannot be restored."""

    reason = "snapshot_error"

    def __init__(self, message: str, *, detail: object = None) -> None:
        self.detail = detail
        super().__init__(message)


class UnsupportedModule(SnapshotError):
    reason = "unsupported_module"


class UnsupportedHook(SnapshotError):
    reason = "unsupported_hook"


class ForwardHookPresent(SnapshotError):
    reason = "forward_hook"


class MaterializedParameters(SnapshotError):
    """Parameters hold real data: the module is past weight loading."""

    reason = "materialized_parameters"

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        shown = ", ".join(self.names[:5]) + (" …" if len(self.names) > 5 else "")
        super().__init__(f"module has materialized (non-meta) parameters: {shown}", detail=self.names)


class UntrustedTarget(SnapshotError):
    """A payload names a callable or class outside the allow-list; nothing was called."""

    reason = "untrusted_target"

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname
        super().__init__(f"snapshot names {qualname!r}, which is outside the allowed prefixes")


class CorruptSnapshot(SnapshotError):
    reason = "corrupt_snapshot"


class CacheKeyError(IntegrationError):
    reason = "key_error"


class RankDisagreement(IntegrationError):
    reason = "rank_disagreement"


class EngineCacheError(IntegrationError):
    reason = "engine_error"


class CorruptEngine(EngineCacheError):
    reason = "corrupt_engine"


class TruncatedEngine(CorruptEngine):
    """A stored engine record is shorter than its header says."""

    reason = "truncated_engine"


class EngineMismatch(EngineCacheError):
    """A stored engine is intact but does not fit this request (hash, format, constants, spec)."""

    reason = "engine_mismatch"

    def __init__(self, what: str, message: str) -> None:
        self.what = what
        super().__init__(f"engine {what} mismatch: {message}")


class EngineUnavailable(EngineCacheError):
    """The backend has the engine's key but cannot serve it (e.g. the store said blob_missing)."""

    reason = "engine_unavailable"

    def __init__(self, key: str, store_reason: str | None) -> None:
        self.key = key
        self.store_reason = store_reason
        super().__init__(f"engine {key} unavailable: {store_reason}")


class UntrustedEngine(EngineCacheError):
    """A stored engine was written by a user this process does not trust; it is native code, so it is not loaded."""

    reason = "untrusted_engine"

    def __init__(self, key: str, owner: int | None, detail: str) -> None:
        self.key = key
        self.owner = owner
        super().__init__(f"engine {key} not loaded: {detail}")
