"""The one error hierarchy of adstore.

Every error raised on purpose by any adstore package derives from
:class:`AdstoreError`.  Errors carry data (digests, keys, ranks) instead of
only a message, and each has a :class:`~adstore.store.reasons.Reason` that the cache layers
report as the reason of a miss or a bypass and that the CLI maps to an exit
code (docs/operations.md, "Reasons").
"""

from __future__ import annotations

from collections.abc import Sequence

from .reasons import Reason

__all__ = [
    "AdstoreError",
    "StoreError",
    "InvalidDigest",
    "InvalidKey",
    "KeyNotFound",
    "AmbiguousKey",
    "BlobMissing",
    "ManifestGone",
    "NotABlobFile",
    "Unreadable",
    "BlobUnreadable",
    "ChecksumMismatch",
    "CorruptRow",
    "UnsupportedFilesystem",
    "UnsafeRoot",
    "NoStore",
    "IncompatibleStore",
    "OverBudget",
    "StoreFull",
    "AccessDenied",
    "ReadOnlyStore",
    "ConfigError",
]


class AdstoreError(Exception):
    """Base of every adstore error; ``reason`` names it in events and stats."""

    reason: Reason = Reason.ERROR


class StoreError(AdstoreError):
    """Something about the store itself (layout, index, files) went wrong."""

    reason: Reason = Reason.STORE_ERROR


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a hostile name must not flood a log or a terminal."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class InvalidDigest(StoreError, ValueError):
    """A digest that is not 64 lowercase hex characters; never joined into a path."""

    reason: Reason = Reason.BAD_DIGEST

    def __init__(self, digest: object) -> None:
        self.digest = digest
        super().__init__(f"invalid blob digest {_shown(digest)}: expected 64 lowercase hex characters")


class InvalidKey(StoreError, ValueError):
    """A cache key, namespace or artifact name the store will not index."""

    reason: Reason = Reason.BAD_KEY

    def __init__(self, key: object, why: str) -> None:
        self.key = key
        self.why = why
        super().__init__(f"invalid key {_shown(key)}: {why}")


class KeyNotFound(InvalidKey, KeyError):
    """No entry's key equals (or, for a prefix, starts with) the given text."""

    reason: Reason = Reason.UNKNOWN_KEY

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        super().__init__(prefix, "no entry has this key or key prefix")

    def __str__(self) -> str:  # KeyError would repr() the argument
        return f"no entry matches key {self.prefix!r}"


class AmbiguousKey(InvalidKey, KeyError):
    """A key prefix matches more than one entry (like an ambiguous short git hash)."""

    reason: Reason = Reason.AMBIGUOUS_KEY

    def __init__(self, prefix: str, candidates: Sequence[str]) -> None:
        self.prefix = prefix
        self.candidates = list(candidates)
        super().__init__(prefix, "ambiguous key prefix")

    def __str__(self) -> str:
        shown = ", ".join(c[:16] for c in self.candidates[:5])
        more = f" and {len(self.candidates) - 5} more" if len(self.candidates) > 5 else ""
        return (
            f"key prefix {self.prefix!r} is ambiguous: it matches {len(self.candidates)} "
            f"entries ({shown}{more}); type more characters"
        )


class BlobMissing(StoreError):
    """A referenced blob has no row, no file, or a file of the wrong size."""

    reason: Reason = Reason.BLOB_MISSING

    def __init__(self, digest: str, detail: str = "") -> None:
        self.digest = digest
        self.detail = detail
        super().__init__(f"blob {digest} is missing" + (f": {detail}" if detail else ""))


class ManifestGone(StoreError):
    """A commit found no published manifest: something removed it between the publish and the commit.

    gc never takes the manifest of a save in flight on this host (its
    producer is a live process); what is left is a save from another host
    cut past the grace period, an entry removed by name, or a manifest
    aborted.  The save failed whole: nothing of it is restorable.
    """

    reason: Reason = Reason.STALE_MANIFEST

    def __init__(self, key: str, rank: int, generation: int) -> None:
        self.key, self.rank, self.generation = key, rank, generation
        super().__init__(f"no manifest to commit for {key} rank {rank} generation {generation}")


class NotABlobFile(BlobMissing):
    """Something other than a regular file where a blob file should be (a symlink, a directory): damage."""


class Unreadable(StoreError):
    """A store file the system would not read (EMFILE, ENOMEM, EIO, EACCES, ...).

    Not proof of damage: the file may be whole and the next read succeed,
    so nothing is quarantined or rebuilt for it.  ``errno`` is the system's.
    """

    reason: Reason = Reason.IO_ERROR

    def __init__(self, path: str, errno: int | None, detail: str) -> None:
        self.path = path
        self.errno = errno
        self.detail = detail
        super().__init__(f"{path} could not be read: {detail}")


class BlobUnreadable(Unreadable):
    """A blob file the system would not read: the blob stays (see :class:`Unreadable`)."""

    def __init__(self, digest: str, errno: int | None, detail: str) -> None:
        self.digest = digest
        super().__init__(f"blob {digest}", errno, detail)


class ChecksumMismatch(StoreError):
    """Blob content does not hash to its digest; the blob has been quarantined."""

    reason: Reason = Reason.CHECKSUM

    def __init__(self, expected: str, got: str, size: int | None = None) -> None:
        self.expected = expected
        self.got = got
        self.size = size
        super().__init__(f"checksum mismatch: expected {expected}, got {got}")


class CorruptRow(StoreError):
    """An LMDB value that does not decode (damaged index)."""

    reason: Reason = Reason.CORRUPT_INDEX

    def __init__(self, db: str, key: bytes | str, detail: str) -> None:
        self.db = db
        self.key = key
        self.detail = detail
        super().__init__(f"corrupt record in {db!r} at {key!r}: {detail}")


class UnsupportedFilesystem(StoreError):
    """The root is on a network filesystem, where LMDB locking is unsafe."""

    reason: Reason = Reason.NETWORK_FS

    def __init__(self, root: str, fstype: str) -> None:
        self.root = root
        self.fstype = fstype
        super().__init__(
            f"refusing store root {root}: it is on a {fstype} filesystem, where LMDB "
            "locking is unsafe; use a local disk (set ADSTORE_ROOT)"
        )


class UnsafeRoot(StoreError):
    """The root is world-writable or owned by another user without group sharing."""

    reason: Reason = Reason.UNSAFE_ROOT

    def __init__(self, root: str, why: str) -> None:
        self.root = root
        self.why = why
        super().__init__(f"refusing store root {root}: {why}")


class NoStore(StoreError):
    """``Store.open(..., create=False)`` found no store at ``root`` (and created nothing), or ``root`` is a file."""

    reason: Reason = Reason.NO_STORE

    def __init__(self, root: str) -> None:
        self.root = root
        super().__init__(
            f"no adstore store at {root} (set --root or ADSTORE_ROOT; a store is created by its first writer)"
        )


class RootNotADirectory(NoStore):
    """The store root, or a directory it would be made in, is a file: no store is there, and none can be made."""

    def __init__(self, root: str, file: str) -> None:
        super().__init__(root)
        self.file = file
        where = "" if file == root else f": {root} cannot be made"
        self.args = (f"{file} is a file, not a directory{where} (set --root or ADSTORE_ROOT to a directory)",)


class IncompatibleStore(StoreError):
    """The index was written with another schema version than this adstore reads."""

    reason: Reason = Reason.INCOMPATIBLE_STORE

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

    reason: Reason = Reason.OVER_BUDGET

    def __init__(self, needed: int, limit: int, size: int) -> None:
        self.needed = needed
        self.limit = limit
        self.size = size
        super().__init__(f"store over budget: {size} bytes stored + {needed} needed > hard limit {limit}")


class StoreFull(StoreError):
    """The filesystem under the store is full (ENOSPC / EDQUOT)."""

    reason: Reason = Reason.DISK_FULL

    def __init__(self, path: str, detail: str = "") -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"no space left writing {path}" + (f": {detail}" if detail else ""))


class AccessDenied(StoreError):
    """The store exists but this user may not open or write it."""

    reason: Reason = Reason.PERMISSION_DENIED

    def __init__(self, path: str, detail: str = "") -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"permission denied on {path}" + (f": {detail}" if detail else ""))


class ReadOnlyStore(StoreError):
    """A write (save, put, gc, rm, pin, a repair) asked of a store that is read-only.

    The store sits on a read-only mount (a store baked into an image) or was
    opened read-only (a seed store): it serves hits, and nothing is written.
    ``what`` names the refused operation.
    """

    reason: Reason = Reason.READ_ONLY

    def __init__(self, root: str, what: str = "write") -> None:
        self.root = root
        self.what = what
        super().__init__(
            f"store {root} is read-only, {what} refused: it serves hits and takes no writes; "
            "write to another store (ADSTORE_ROOT), with this one as its seed (ADSTORE_SEED)"
        )


class ConfigError(AdstoreError, ValueError):
    """Invalid configuration; ``field`` names the offending setting."""

    reason: Reason = Reason.CONFIG

    def __init__(self, field: str, why: str) -> None:
        self.field = field
        self.why = why
        super().__init__(f"invalid configuration for {field!r}: {why}")


class MissingExtra(ConfigError):
    """A feature needs a package of an optional extra that is not installed: the message names the extra.

    A :class:`ConfigError` (the feature was configured, the install cannot do
    it), whose text is the fix, ``pip install 'adstore[EXTRA]'``, rather than
    a setting that is fine.
    """

    def __init__(self, feature: str, package: str, extra: str) -> None:
        super().__init__(f"adstore[{extra}]", f"{feature} needs {package}")
        self.feature = feature
        self.package = package
        self.extra = extra
        self.args = (f"{feature} needs {package}, from the {extra!r} extra: pip install 'adstore[{extra}]'",)
