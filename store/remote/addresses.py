"""Where objects live on a remote: the two kinds and their digests.

The layout is the Bazel remote-cache one (README, "Remote tier"): ``cas/<sha256>``
holds blobs by the SHA-256 of their content, ``ac/<sha256>`` holds per-key
records (and build leases) by the SHA-256 of a name.  A digest is validated
here, in one place, before any backend joins it into a URL or an object key,
so a record naming ``../../x`` can never address another object.
"""

from __future__ import annotations

import enum
import hashlib
import re

from ..errors import InvalidDigest

__all__ = ["Kind", "check_digest", "object_name", "record_address", "lease_address"]

_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class Kind(enum.StrEnum):
    """The two namespaces of a remote."""

    CAS = "cas"  # blobs, addressed by the SHA-256 of their content
    AC = "ac"  # records and leases, addressed by the SHA-256 of their name


def check_digest(digest: object) -> str:
    """Return ``digest`` if it is 64 lowercase hex characters, else raise InvalidDigest."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidDigest(digest)
    return digest


def object_name(kind: Kind | str, digest: str) -> str:
    """``cas/<digest>`` or ``ac/<digest>``, after validating both parts."""
    return f"{Kind(kind).value}/{check_digest(digest)}"


def _name_digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def record_address(key: str, rank: int) -> str:
    """The ``ac`` digest of the record of ``key`` for ``rank``."""
    return _name_digest(f"record:{key}:{int(rank)}")


def lease_address(key: str) -> str:
    """The ``ac`` digest of the single-flight build lease of ``key``."""
    return _name_digest(f"lease:{key}")
