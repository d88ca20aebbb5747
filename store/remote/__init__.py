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

from ..lazy import exports
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

#: Every other public name, and the module it comes from: imported on first use (``store.lazy``),
#: so a process that only names a lease role or an address never loads the HTTP, S3 or signing code.
_LAZY = {
    "interruptible": ".calls",
    "Kind": ".addresses",
    "lease_address": ".addresses",
    "object_name": ".addresses",
    "record_address": ".addresses",
    "ConditionalWrites": ".backend",
    "RemoteBackend": ".backend",
    "DEFAULT_COOLDOWN": ".breaker",
    "BreakerState": ".breaker",
    "CircuitBreaker": ".breaker",
    "DEFAULT_CONNECT_TIMEOUT": ".client",
    "DEFAULT_READ_TIMEOUT": ".client",
    "MAX_ENVELOPE_BYTES": ".client",
    "Remote": ".client",
    "RemoteConfig": ".config",
    "open_remote": ".config",
    "parse_mode": ".config",
    "register_scheme": ".config",
    "DEFAULT_DEADLINE": ".deadline",
    "DEFAULT_MIN_THROUGHPUT": ".deadline",
    "Deadline": ".deadline",
    "Limits": ".deadline",
    "HttpBackend": ".httpcache",
    "MemoryBackend": ".memory",
    "S3Backend": ".s3",
    "ENVELOPE_VERSION": ".signing",
    "KeyPair": ".signing",
    "Signer": ".signing",
    "TrustedKeys": ".signing",
    "Verified": ".signing",
    "generate_keypair": ".signing",
    "write_keypair": ".signing",
    "DEFAULT_TTL": ".singleflight",
    "Flight": ".singleflight",
    "Lease": ".singleflight",
    "Role": ".singleflight",
    "SingleFlight": ".singleflight",
    "WaitResult": ".singleflight",
    "BlobSink": ".transfer",
    "BlobSource": ".transfer",
    "BackgroundUploader": ".uploader",
}
__getattr__, __dir__ = exports(__name__, _LAZY, globals())

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
