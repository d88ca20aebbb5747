"""The one error hierarchy of adstore.

Every error raised on purpose by any adstore package derives from
:class:`AdstoreError`.  Errors carry data (digests, keys, ranks) instead of
only a message, and each has a short machine-readable ``reason`` that the
cache layers report as the reason of a miss or a bypass and that the CLI maps
to an exit code.
"""

from __future__ import annotations

__all__ = [
    "AdstoreError",
    "StoreError",
    "InvalidDigest",
    "InvalidKey",
    "BlobMissing",
    "ChecksumMismatch",
    "CorruptRecord",
    "UnsupportedFilesystem",
    "UnsafeRoot",
    "IncompatibleStore",
    "OverBudget",
    "StoreFull",
    "LeaseError",
    "AccessDenied",
    "ConfigError",
]


class AdstoreError(Exception):
    """Base of every adstore error; ``reason`` names it in events and stats."""

    reason = "error"


class StoreError(AdstoreError):
    """Something about the store itself (layout, index, files) went wrong."""

    reason = "store_error"


class InvalidDigest(StoreError, ValueError):
    """A digest that is not 64 lowercase hex characters; never joined into a path."""

    reason = "bad_digest"

    def __init__(self, digest: object) -> None:
        self.digest = digest
        super().__init__(f"invalid blob digest {digest!r}: expected 64 lowercase hex characters")


class InvalidKey(StoreError, ValueError):
    """A cache key, namespace or artifact name the store will not index."""

    reason = "bad_key"

    def __init__(self, key: object, why: str) -> None:
        self.key = key
        self.why = why
        super().__init__(f"invalid key {key!r}: {why}")


class BlobMissing(StoreError):
    """A referenced blob has no row, no file, or a file of the wrong size."""

    reason = "blob_missing"

    def __init__(self, digest: str, detail: str = "") -> None:
        self.digest = digest
        self.detail = detail
        super().__init__(f"blob {digest} is missing" + (f": {detail}" if detail else ""))


class ChecksumMismatch(StoreError):
    """Blob content does not hash to its digest; the blob has been quarantined."""

    reason = "checksum"

    def __init__(self, expected: str, got: str, size: int | None = None) -> None:
        self.expected = expected
        self.got = got
        self.size = size
        super().__init__(f"checksum mismatch: expected {expected}, got {got}")


class CorruptRecord(StoreError):
    """An LMDB value that does not decode (damaged index)."""

    reason = "corrupt_index"

    def __init__(self, db: str, key: bytes | str, detail: str) -> None:
        self.db = db
        self.key = key
        self.detail = detail
        super().__init__(f"corrupt record in {db!r} at {key!r}: {detail}")


class UnsupportedFilesystem(StoreError):
    """The root is on a network filesystem, where LMDB locking is unsafe."""

    reason = "network_fs"

    def __init__(self, root: str, fstype: str) -> None:
        self.root = root
        self.fstype = fstype
        super().__init__(
            f"refusing store root {root}: it is on a {fstype} filesystem, where LMDB "
            "locking is unsafe; use a local disk (set ADSTORE_ROOT)"
        )


class UnsafeRoot(StoreError):
    """The root is world-writable or owned by another user without group sharing."""

    reason = "unsafe_root"

    def __init__(self, root: str, why: str) -> None:
        self.root = root
        self.why = why
        super().__init__(f"refusing store root {root}: {why}")


class IncompatibleStore(StoreError):
    """The index was written with another schema version than this adstore reads."""

    reason = "incompatible_store"

    def __init__(self, root: str, found: str, expected: int) -> None:
        self.root = root
        self.found = found
        self.expected = expected
        super().__init__(
            f"refusing store root {root}: its index has schema {found}, this adstore reads schema "
            f"{expected}; the store is a cache, so move it aside or delete it, or set ADSTORE_ROOT"
        )


class OverBudget(StoreError):
    """A write would exceed the hard size limit and inline eviction cannot make room."""

    reason = "over_budget"

    def __init__(self, needed: int, limit: int, size: int) -> None:
        self.needed = needed
        self.limit = limit
        self.size = size
        super().__init__(
            f"store over budget: {size} bytes stored + {needed} needed > hard limit {limit}"
        )


class StoreFull(StoreError):
    """The filesystem under the store is full (ENOSPC / EDQUOT)."""

    reason = "disk_full"

    def __init__(self, path: str, detail: str = "") -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"no space left writing {path}" + (f": {detail}" if detail else ""))


class AccessDenied(StoreError):
    """The store exists but this user may not open or write it."""

    reason = "permission_denied"

    def __init__(self, path: str, detail: str = "") -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"permission denied on {path}" + (f": {detail}" if detail else ""))


class LeaseError(StoreError):
    reason = "lease"


class ConfigError(AdstoreError, ValueError):
    """Invalid configuration; ``field`` names the offending setting."""

    reason = "config"

    def __init__(self, field: str, why: str) -> None:
        self.field = field
        self.why = why
        super().__init__(f"invalid configuration for {field!r}: {why}")
