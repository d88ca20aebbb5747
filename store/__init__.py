"""adstore.store: a content-addressed blob store indexed by LMDB (no torch).

Blobs are deduplicated by SHA-256; cache keys map to per-rank manifests that
reference blobs; entries are evicted least-recently-used as whole keys.  The README's
"Using the store" lists the layout and the invariants every operation keeps.
"""

from .errors import (
    AccessDenied,
    AdstoreError,
    AmbiguousKey,
    BlobMissing,
    ChecksumMismatch,
    ConfigError,
    CorruptRecord,
    IncompatibleStore,
    InvalidDigest,
    InvalidKey,
    KeyNotFound,
    NoStore,
    OverBudget,
    StoreError,
    StoreFull,
    UnsafeRoot,
    UnsupportedFilesystem,
)
from .fsutil import atomic_write
from .budget import DEFAULT_GRACE_PERIOD, Budget
from .clock import Clock, ManualClock, system_clock
from .eviction import EvictedBatch, EvictionPlan, PlanKind
from .lookup import LookupResult
from .reasons import Reason
from .records import BlobRef, Entry, LeaseRecord, Manifest
from .stats import StoreStats
from .store import DEFAULT_INLINE_THRESHOLD, Store, default_root
from .sweep import SweepPlan
from .units import (
    MinFree,
    human_size,
    parse_duration,
    parse_fraction,
    parse_min_free,
    parse_percent,
    parse_size,
)
from .verify import Finding, VerifyReport

__all__ = [
    "Store",
    "default_root",
    "Clock",
    "ManualClock",
    "system_clock",
    "DEFAULT_GRACE_PERIOD",
    "DEFAULT_INLINE_THRESHOLD",
    "BlobRef",
    "Entry",
    "Manifest",
    "LeaseRecord",
    "LookupResult",
    "Reason",
    "Budget",
    "PlanKind",
    "EvictionPlan",
    "EvictedBatch",
    "SweepPlan",
    "VerifyReport",
    "Finding",
    "StoreStats",
    "atomic_write",
    "parse_size",
    "parse_min_free",
    "parse_percent",
    "parse_fraction",
    "parse_duration",
    "MinFree",
    "human_size",
    "AdstoreError",
    "AccessDenied",
    "StoreError",
    "InvalidDigest",
    "InvalidKey",
    "KeyNotFound",
    "NoStore",
    "AmbiguousKey",
    "BlobMissing",
    "ChecksumMismatch",
    "CorruptRecord",
    "UnsupportedFilesystem",
    "UnsafeRoot",
    "IncompatibleStore",
    "OverBudget",
    "StoreFull",
    "ConfigError",
]
