"""adstore.store.remote: the remote tier (a second tier behind the local store).

A remote is named by a URL: ``s3://BUCKET/PREFIX`` (boto3) or
``http(s)://HOST:PORT/PREFIX`` (the Bazel remote-cache HTTP protocol), in
mode ``read`` or ``read-write``.  :class:`Remote` is the one public door: it
enforces the mode, bounds every call by a timeout and a circuit breaker,
verifies blobs by SHA-256 and records by Ed25519 signature, and returns
outcomes with reasons instead of raising.  :class:`SingleFlight` lets one
host build a cold key while the others wait; :class:`BackgroundUploader`
pushes behind the pipeline.  ``boto3`` and ``cryptography`` are imported
only when an S3 remote is opened or a key is used (extra ``remote``).  The
docs/remote.md describes the protocol, the trust model and the
defaults.
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports
from .errors import (
    NotSupported,
    ReadOnlyRemote,
    RemoteBlobMissing,
    RemoteChecksumMismatch,
    RemoteError,
    RemoteProtocolError,
    RemoteRejected,
    RemoteTimeout,
    RemoteUnavailable,
    UntrustedRecord,
)
from .outcomes import Mode, Outcome

if TYPE_CHECKING:
    from .addresses import Kind, lease_address, object_name, record_address
    from .backend import ConditionalWrites, RemoteBackend
    from .breaker import DEFAULT_COOLDOWN, BreakerState, CircuitBreaker
    from .calls import interruptible
    from .client import DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT, MAX_ENVELOPE_BYTES, Remote
    from .config import RemoteConfig, open_remote, parse_mode, register_scheme
    from .deadline import DEFAULT_DEADLINE, DEFAULT_MIN_THROUGHPUT, Deadline, Limits
    from .httpcache import HttpBackend
    from .memory import MemoryBackend
    from .s3 import S3Backend
    from .signing import ENVELOPE_VERSION, KeyPair, Signer, TrustedKeys, Verified, generate_keypair, write_keypair
    from .singleflight import DEFAULT_TTL, Flight, Lease, Role, SingleFlight, WaitResult
    from .transfer import BlobSink, BlobSource
    from .uploader import BackgroundUploader

#: Every other public name, by the module it comes from: imported on first use (``store.lazy``),
#: so a process that only names a lease role or an address never loads the HTTP, S3 or signing code.
_LAZY = {
    ".calls": ("interruptible",),
    ".addresses": ("Kind", "lease_address", "object_name", "record_address"),
    ".backend": ("ConditionalWrites", "RemoteBackend"),
    ".breaker": ("DEFAULT_COOLDOWN", "BreakerState", "CircuitBreaker"),
    ".client": ("DEFAULT_CONNECT_TIMEOUT", "DEFAULT_READ_TIMEOUT", "MAX_ENVELOPE_BYTES", "Remote"),
    ".config": ("RemoteConfig", "open_remote", "parse_mode", "register_scheme"),
    ".deadline": ("DEFAULT_DEADLINE", "DEFAULT_MIN_THROUGHPUT", "Deadline", "Limits"),
    ".httpcache": ("HttpBackend",),
    ".memory": ("MemoryBackend",),
    ".s3": ("S3Backend",),
    ".signing": (
        "ENVELOPE_VERSION",
        "KeyPair",
        "Signer",
        "TrustedKeys",
        "Verified",
        "generate_keypair",
        "write_keypair",
    ),
    ".singleflight": ("DEFAULT_TTL", "Flight", "Lease", "Role", "SingleFlight", "WaitResult"),
    ".transfer": ("BlobSink", "BlobSource"),
    ".uploader": ("BackgroundUploader",),
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "RemoteProtocolError",
    "interruptible",
    # opening
    "open_remote",
    "RemoteConfig",
    "register_scheme",
    "parse_mode",
    "Mode",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_COOLDOWN",
    "DEFAULT_DEADLINE",
    "DEFAULT_MIN_THROUGHPUT",
    "Deadline",
    "Limits",
    "MAX_ENVELOPE_BYTES",
    # the public layer
    "Remote",
    "Outcome",
    "BlobSink",
    "BlobSource",
    "CircuitBreaker",
    "BreakerState",
    "BackgroundUploader",
    "SingleFlight",
    "Flight",
    "Role",
    "Lease",
    "WaitResult",
    "DEFAULT_TTL",
    # signatures
    "Signer",
    "TrustedKeys",
    "Verified",
    "KeyPair",
    "generate_keypair",
    "write_keypair",
    "ENVELOPE_VERSION",
    # backends
    "RemoteBackend",
    "ConditionalWrites",
    "S3Backend",
    "HttpBackend",
    "MemoryBackend",
    # addresses
    "Kind",
    "object_name",
    "record_address",
    "lease_address",
    # reasons and errors
    "RemoteError",
    "RemoteUnavailable",
    "RemoteTimeout",
    "RemoteRejected",
    "ReadOnlyRemote",
    "NotSupported",
    "RemoteBlobMissing",
    "RemoteChecksumMismatch",
    "UntrustedRecord",
]
