"""What the index holds: its schema version and its named databases (no lmdb import: cheap for the file checks).

The version names a layout of the rows; an index of another version is
upgraded when a migration leads here (``migrations``), else refused.

* 2: inline blobs are stored with an xxh3-64 head (was a CRC-32 in the blob row).
* 3: an entry's last access and hits moved from its JSON row to ``access``.
* 4: no owed references (``releases``); a write count in ``meta``.
* 5: blob files may be zstd frames (``FLAG_ZSTD``); a blob row keeps the size its file takes.
"""

from __future__ import annotations

__all__ = [
    "SCHEMA_VERSION",
    "DATABASES",
    "ENTRY_TABLES",
    "PHYSICAL_BYTES",
    "CONTENT_BYTES",
    "LOGICAL_BYTES",
    "PINNED_BYTES",
    "BLOB_EPOCH",
    "STATS_ZEROED",
    "WRITES",
]

SCHEMA_VERSION = 5

#: The named databases of the index (``entry_shadow``: see ``shadows``).
DATABASES = (
    "blobs",
    "blobdata",
    "entries",
    "entry_shadow",
    "access",
    "components",
    "manifests",
    "leases",
    "stats",
    "meta",
)

#: The tables whose row under an entry's key belongs to the entry: written with it, removed with it.
ENTRY_TABLES = ("entries", "entry_shadow", "access", "components")

# Names in ``meta``.  The totals would otherwise need a full scan; ``verify --fix`` recounts them.
#: Bytes of every registered blob as stored (files, compressed or not, and inline values): what budgets limit.
PHYSICAL_BYTES = b"physical_bytes"
#: Bytes of every registered blob's content (each blob once: after deduplication, before compression).
CONTENT_BYTES = b"content_bytes"
#: Bytes of every entry's current manifests (each blob counted per entry that holds it).
LOGICAL_BYTES = b"logical_bytes"
#: The logical bytes of pinned entries.
PINNED_BYTES = b"pinned_bytes"
#: Moved by every transaction that takes a blob row away from lookups (drops it, quarantines it,
#: replaces it), so that a lookup may trust blob rows it checked before while this value is
#: unchanged (``lookup.LookupMemo``).
BLOB_EPOCH = b"blob_epoch"
#: How many write transactions committed, counted by each of them (lock-only ones excepted): a
#: reader that sees the same count later knows no row changed in between (eviction).
WRITES = b"writes"
#: When the counters were last zeroed (``adstore stats --zero``), in whole epoch seconds; absent: never.
STATS_ZEROED = b"stats_zeroed"
