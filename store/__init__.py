"""adstore.store: a content-addressed blob store indexed by LMDB (no torch).

Blobs are deduplicated by SHA-256; cache keys map to per-rank manifests that
reference blobs; entries are evicted least-recently-used as whole keys.  This
module is the store's public API: the integration, the daemon and users
import from here (and from :mod:`adstore.store.remote`, the remote tier's
own public API), never from the modules behind it.  The layers behind it,
bottom up: names, errors, files and the trust rule (``names``, ``errors``, ``fsutil``,
``layout``, ``trust``), the LMDB index (``index/``), blobs and manifests, the on-disk
records (``records/``), the maintenance passes (``maintenance/``), the remote
tier (``remote/``), and the :class:`Store` facade.
"""

from typing import TYPE_CHECKING

from .clock import Clock, ManualClock, system_clock
from .errors import (
    AccessDenied,
    AdstoreError,
    AmbiguousKey,
    BlobMissing,
    ChecksumMismatch,
    ConfigError,
    CorruptRow,
    IncompatibleStore,
    InvalidDigest,
    InvalidKey,
    KeyNotFound,
    ManifestGone,
    NoStore,
    OverBudget,
    ReadOnlyStore,
    StoreError,
    StoreFull,
    UnsafeRoot,
    UnsupportedFilesystem,
)
from .lazy import lazy_exports
from .names import is_digest, is_key, validate_artifact_name, validate_digest, validate_key, validate_namespace
from .reasons import REMOTE_REASONS, Reason

if TYPE_CHECKING:
    from .fsutil import atomic_write, is_disk_full
    from .index.rows import BlobRef, Entry, LeaseRow, Manifest
    from .layout import Layout, default_root
    from .leases import hostname, process_start_time
    from .lookup import LookupResult
    from .maintenance.budget import DEFAULT_GRACE_PERIOD, Budget
    from .maintenance.deadtemps import DeadTempPlan, default_temp_dirs, plan_dead_temps
    from .maintenance.eviction import EvictedBatch, EvictionPlan, PlanKind
    from .maintenance.sweep import SweepPlan
    from .maintenance.verify import Finding, VerifyReport
    from .stats import StoreStats
    from .store import DEFAULT_INLINE_THRESHOLD, Store
    from .tiered import Tier, open_tier, remote_restore, remote_save
    from .trust import StatLike, dir_refusal, file_refusal, group_private, others_may_write, trusted_uids
    from .units import (
        DURATION_HELP,
        SIZE_HELP,
        MinFree,
        format_duration,
        human_size,
        parse_count,
        parse_duration,
        parse_fraction,
        parse_min_free,
        parse_percent,
        parse_size,
    )

#: Every other public name, by the module it comes from: imported on first use (``lazy``).
_LAZY = {
    ".fsutil": ("atomic_write", "is_disk_full"),
    ".index.rows": ("BlobRef", "Entry", "LeaseRow", "Manifest"),
    ".layout": ("Layout", "default_root"),
    ".leases": ("hostname", "process_start_time"),
    ".lookup": ("LookupResult",),
    ".maintenance.budget": ("DEFAULT_GRACE_PERIOD", "Budget"),
    ".maintenance.deadtemps": ("DeadTempPlan", "default_temp_dirs", "plan_dead_temps"),
    ".maintenance.eviction": ("EvictedBatch", "EvictionPlan", "PlanKind"),
    ".maintenance.sweep": ("SweepPlan",),
    ".maintenance.verify": ("Finding", "VerifyReport"),
    ".stats": ("StoreStats",),
    ".store": ("DEFAULT_INLINE_THRESHOLD", "Store"),
    ".tiered": ("Tier", "open_tier", "remote_restore", "remote_save"),
    ".trust": ("StatLike", "trusted_uids", "group_private", "others_may_write", "file_refusal", "dir_refusal"),
    ".units": (
        "DURATION_HELP",
        "SIZE_HELP",
        "MinFree",
        "format_duration",
        "human_size",
        "parse_count",
        "parse_duration",
        "parse_fraction",
        "parse_min_free",
        "parse_percent",
        "parse_size",
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    # the store
    "Store",
    "default_root",
    "DEFAULT_GRACE_PERIOD",
    "DEFAULT_INLINE_THRESHOLD",
    "Layout",
    "Clock",
    "ManualClock",
    "system_clock",
    # what it holds and answers
    "BlobRef",
    "Entry",
    "Manifest",
    "LeaseRow",
    "LookupResult",
    "Reason",
    "REMOTE_REASONS",
    "StoreStats",
    # names
    "validate_key",
    "validate_digest",
    "validate_namespace",
    "validate_artifact_name",
    "is_key",
    "is_digest",
    # maintenance: plans, budget, verify
    "Budget",
    "PlanKind",
    "EvictionPlan",
    "EvictedBatch",
    "SweepPlan",
    "DeadTempPlan",
    "plan_dead_temps",
    "default_temp_dirs",
    "VerifyReport",
    "Finding",
    # the remote tier behind a store (the remote itself: adstore.store.remote)
    "Tier",
    "open_tier",
    "remote_restore",
    "remote_save",
    # the trust rule: who may have written a file or a row
    "trusted_uids",
    "group_private",
    "others_may_write",
    "file_refusal",
    "dir_refusal",
    "StatLike",
    # files, processes, units
    "atomic_write",
    "is_disk_full",
    "hostname",
    "process_start_time",
    "parse_size",
    "parse_count",
    "parse_min_free",
    "parse_percent",
    "parse_fraction",
    "parse_duration",
    "format_duration",
    "human_size",
    "lazy_exports",
    "MinFree",
    "SIZE_HELP",
    "DURATION_HELP",
    # errors
    "AdstoreError",
    "AccessDenied",
    "StoreError",
    "InvalidDigest",
    "InvalidKey",
    "KeyNotFound",
    "NoStore",
    "AmbiguousKey",
    "BlobMissing",
    "ManifestGone",
    "ChecksumMismatch",
    "CorruptRow",
    "UnsupportedFilesystem",
    "UnsafeRoot",
    "IncompatibleStore",
    "OverBudget",
    "StoreFull",
    "ReadOnlyStore",
    "ConfigError",
]
