"""Where objects live on a remote: the two kinds and their digests.

The layout is the Bazel remote-cache one (docs/remote.md, "URLs and modes"): ``cas/<sha256>``
holds blobs by the SHA-256 of their content, ``ac/<sha256>`` holds per-key
records (and build leases) by the SHA-256 of a name.  On a remote that ships
blobs compressed (S3), a blob the store keeps compressed travels as its file
under ``zcas/<sha256>`` (still named by its content's digest), and the
record that lists it says so (``stored``): ``cas/`` always holds raw bytes,
as Bazel clients expect.  A digest is validated
(``names.validate_digest``) before any backend joins it into a URL or an object key,
so a record naming ``../../x`` can never address another object.
"""

from __future__ import annotations

import enum
import hashlib

from ..names import validate_digest

__all__ = ["Kind", "object_name", "record_address", "lease_address"]


class Kind(enum.StrEnum):
    """The two namespaces of a remote."""

    CAS = "cas"  # blobs, addressed by the SHA-256 of their content
    ZCAS = "zcas"  # blobs as their compressed files, addressed by the SHA-256 of their content (S3 only; never Bazel's)
    AC = "ac"  # records and leases, addressed by the SHA-256 of their name


def object_name(kind: Kind | str, digest: str) -> str:
    """``cas/<digest>`` or ``ac/<digest>``, after validating both parts."""
    return f"{Kind(kind).value}/{validate_digest(digest)}"


def _name_digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def record_address(key: str, rank: int) -> str:
    """The ``ac`` digest of the record of ``key`` for ``rank``."""
    return _name_digest(f"record:{key}:{int(rank)}")


def lease_address(key: str) -> str:
    """The ``ac`` digest of the single-flight build lease of ``key``."""
    return _name_digest(f"lease:{key}")
