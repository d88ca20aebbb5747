"""Every name the store accepts, and its one validator: keys, digests, namespaces, artifact names, numbers.

A name reaches the store from a caller, a command line, an index row, a
record file, a file name in ``blobs/`` or a remote record; it becomes an
LMDB key, part of a file name or a path.  So each kind of name has one rule,
written here once and used by every layer (the store, the records, the
remote tier, the sweep, the CLI).  A rule matches the *whole* string
(``fullmatch``: ``re.match`` with ``$`` lets a trailing newline through) over
ASCII classes only, so a control character, a trailing newline or any
non-ASCII character is refused everywhere with the same error.  Numbers are
exact ``int`` (``True`` is not a rank) within their ranges.

The ``is_*`` forms answer without raising, for scans over many names (file
names in a directory, digests in a row).
"""

from __future__ import annotations

import re
from typing import Final

from .errors import InvalidDigest, InvalidKey

__all__ = [
    "KEY_PATTERN",
    "MAX_KEY_LENGTH",
    "validate_key",
    "validate_digest",
    "validate_namespace",
    "validate_artifact_name",
    "validate_world_size",
    "validate_rank",
    "validate_generation",
    "validate_size",
    "is_key",
    "is_digest",
    "MAX_WORLD_SIZE",
    "MAX_GENERATION",
    "MAX_SIZE",
]

#: A cache key: what callers name entries by (SHA-256 hex in practice); also a file name under ``records/``.
KEY_PATTERN: Final = r"[A-Za-z0-9][A-Za-z0-9._:+=@-]{0,199}"
MAX_KEY_LENGTH: Final = 200
_KEY = re.compile(KEY_PATTERN, re.ASCII)
_DIGEST = re.compile(r"[0-9a-f]{64}", re.ASCII)
_NAMESPACE = re.compile(r"[a-z0-9_]{1,32}", re.ASCII)
_ARTIFACT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}", re.ASCII)

MAX_WORLD_SIZE: Final = (1 << 31) - 1
MAX_GENERATION: Final = (1 << 63) - 1
MAX_SIZE: Final = (1 << 62) - 1


def is_key(value: object) -> bool:
    return type(value) is str and _KEY.fullmatch(value) is not None


def is_digest(value: object) -> bool:
    return type(value) is str and _DIGEST.fullmatch(value) is not None


def validate_key(value: object) -> str:
    """A cache key: 1-200 characters from ``[A-Za-z0-9._:+=@-]``, starting with a letter or digit."""
    if type(value) is not str:
        raise InvalidKey(value, "a cache key must be a string")
    if _KEY.fullmatch(value) is None:
        raise InvalidKey(value, "use 1-200 characters from [A-Za-z0-9._:+=@-], starting with a letter or digit")
    return value


def validate_digest(value: object) -> str:
    """A blob digest: 64 lowercase hex characters (checked before it is ever joined into a path)."""
    if type(value) is not str or _DIGEST.fullmatch(value) is None:
        raise InvalidDigest(value)
    return value


def validate_namespace(value: object) -> str:
    """A namespace: 1-32 characters from ``[a-z0-9_]``."""
    if type(value) is not str or _NAMESPACE.fullmatch(value) is None:
        raise InvalidKey(value, "a namespace is 1-32 characters from [a-z0-9_]")
    return value


def validate_artifact_name(value: object) -> str:
    """An artifact name: 1-128 characters from ``[A-Za-z0-9._+-]``, starting with a letter or digit."""
    if type(value) is not str or _ARTIFACT.fullmatch(value) is None:
        raise InvalidKey(value, "an artifact name is 1-128 characters from [A-Za-z0-9._+-]")
    return value


def _int_in(value: object, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise InvalidKey(value, f"{what} must be an integer in [{low}, {high}]")
    return value


def validate_world_size(value: object) -> int:
    return _int_in(value, 1, MAX_WORLD_SIZE, "a world size")


def validate_rank(value: object, world_size: int) -> int:
    return _int_in(value, 0, world_size - 1, "a rank")


def validate_generation(value: object) -> int:
    return _int_in(value, 1, MAX_GENERATION, "a generation")


def validate_size(value: object) -> int:
    return _int_in(value, 0, MAX_SIZE, "a blob size")
