"""Every named outcome of adstore: why a lookup missed, a cache bypassed, a check failed.

A :class:`Reason` is a ``StrEnum``: it compares equal to its word
(``Reason.ABSENT == "absent"``), so JSON output, counter names
(``misses.absent``) and the CLI keep the words listed here.  The store, the
remote tier, the pipeline cache, the engine cache, the daemon and ``verify`` all take their
reasons from this one list (docs/operations.md, "Reasons").
"""

from __future__ import annotations

import enum

__all__ = ["Reason", "REMOTE_REASONS"]


class Reason(enum.StrEnum):
    """Why something did not happen (a miss, a bypass, an error, a verify finding)."""

    # -- lookup misses (store) ---------------------------------------------
    ABSENT = "absent"  # no entry has this key
    UNCOMMITTED = "uncommitted"  # a rank's manifest exists but was never committed (a save in flight)
    INCOMPLETE = "incomplete"  # a rank of the world size has no committed manifest
    GENERATION_MISMATCH = "generation_mismatch"  # ranks (or peers) hold different generations
    BLOB_MISSING = "blob_missing"  # a referenced blob has no row, no file, the wrong size, or is quarantined
    CHECKSUM = "checksum"  # blob content does not hash to its digest (quarantined)
    CORRUPT_INDEX = "corrupt_index"  # an index row or the index itself does not decode
    INCOMPATIBLE_ENV = (
        "incompatible_env"  # an entry for this request was built in another environment (torch, ABI, CPU, GPU)
    )
    UNSEALED_ENTRY = (
        "unsealed_entry"  # a code entry's index rows disagree with its record, or no trusted user wrote that record
    )

    # -- store errors ------------------------------------------------------
    ERROR = "error"  # an adstore error without a more precise reason
    IO_ERROR = "io_error"  # an OSError outside the store's own checks (a failed read or write)
    STORE_ERROR = "store_error"  # something about the store (layout, index, files) went wrong
    BAD_DIGEST = "bad_digest"  # a digest that is not 64 lowercase hex characters
    BAD_KEY = "bad_key"  # a key, namespace or artifact name the store will not index
    NETWORK_FS = "network_fs"  # the root is on a network filesystem (LMDB locking is unsafe)
    UNSAFE_ROOT = (
        "unsafe_root"  # world-writable root, a symlink for a file it writes, or an unfrozen store on a read-only mount
    )
    NO_STORE = "no_store"  # a read-only command found no store at the root (and created none)
    INCOMPATIBLE_STORE = "incompatible_store"  # the index has another schema version
    OVER_BUDGET = (
        "over_budget"  # a write would pass the hard limit and inline eviction cannot help; gc cannot get under it
    )
    DISK_FULL = "disk_full"  # the filesystem under the store is full (ENOSPC, EDQUOT)
    PERMISSION_DENIED = "permission_denied"  # this user may not open or write the store
    READ_ONLY = "read_only"  # a write asked of a store opened read-only (a read-only mount, a seed store)
    CONFIG = "config"  # an invalid setting
    UNKNOWN_KEY = "unknown_key"  # no entry's key equals or starts with the given text
    AMBIGUOUS_KEY = "ambiguous_key"  # a key prefix matches more than one entry

    # -- remote tier ---------------------------------------------------------
    REMOTE_UNAVAILABLE = "remote_unavailable"  # refused, reset, DNS, 5xx, or the circuit is open after one
    REMOTE_TIMEOUT = "remote_timeout"  # a connect or read timed out (or the circuit is open after one)
    REMOTE_ERROR = "remote_error"  # the server refused the request (4xx other than 404/412): credentials, protocol
    REMOTE_READ_ONLY = "remote_read_only"  # a write asked of a client in read mode (never sent)
    REMOTE_UNSUPPORTED = "remote_unsupported"  # the backend lacks the operation (put-if-absent)
    REMOTE_BLOB_MISSING = "remote_blob_missing"  # a record references a blob the remote no longer has
    REMOTE_CHECKSUM = "remote_checksum"  # a remote blob does not hash to its digest or has another size
    UNTRUSTED_REMOTE = "untrusted_remote"  # a record unsigned, forged, tampered, by an unknown key, or misplaced
    SINGLE_FLIGHT_TIMEOUT = "single_flight_timeout"  # the builder did not publish within the wait
    BUILDER_GONE = "builder_gone"  # the builder's lease expired, its process died, or it released without a record

    # -- pipeline cache (bypasses and misses) ------------------------------
    RESTORE_DISABLED = "restore_disabled"  # restore switched off by configuration
    SAVE_DISABLED = "save_disabled"  # save switched off by configuration
    TOPOLOGY_MISMATCH = "topology_mismatch"  # the entry was saved for another world size
    PEER_MISS = "peer_miss"  # this rank hit but another rank missed
    PEER_RESTORE_FAILED = "peer_restore_failed"  # another rank failed to load its snapshot
    PEER_SAVE_FAILED = "peer_save_failed"  # another rank failed to save (nothing committed)
    PEER_COMMIT_FAILED = "peer_commit_failed"  # another rank failed to commit

    # -- integration errors ------------------------------------------------
    INTEGRATION_ERROR = "integration_error"  # a torch-side error without a more precise reason
    SNAPSHOT_ERROR = "snapshot_error"  # a module cannot be snapshotted or restored
    UNSUPPORTED_MODULE = "unsupported_module"  # the module holds something the codec cannot encode
    UNSUPPORTED_HOOK = "unsupported_hook"  # a load-state-dict hook with no registered spec
    FORWARD_HOOK = "forward_hook"  # a forward hook is present (not cached)
    MATERIALIZED_PARAMETERS = "materialized_parameters"  # parameters hold data: past weight loading
    UNTRUSTED_TARGET = "untrusted_target"  # a snapshot names a callable outside the allow-list
    CORRUPT_SNAPSHOT = "corrupt_snapshot"  # a snapshot's bytes do not decode
    KEY_ERROR = "key_error"  # a cache key (or engine hash) cannot be computed
    RANK_DISAGREEMENT = "rank_disagreement"  # ranks did not agree on what to do
    SHARDING = "sharding"  # the sharding transform refused the topology

    # -- engine cache ------------------------------------------------------
    ENGINE_ERROR = "engine_error"  # an engine-cache error without a more precise reason
    CORRUPT_ENGINE = "corrupt_engine"  # a stored engine record does not decode
    TRUNCATED_ENGINE = "truncated_engine"  # a stored engine record is shorter than it says
    ENGINE_MISMATCH = "engine_mismatch"  # a stored engine belongs to another hash or spec
    ENGINE_UNAVAILABLE = "engine_unavailable"  # the back end cannot serve the engine
    UNTRUSTED_ENGINE = "untrusted_engine"  # an engine from a source that is not trusted
    BYPASS = "bypass"  # the graph could not be hashed: compiled without the cache
    IGNORED = "ignored"  # the caller asked to ignore the cache
    BACKEND_ERROR = "backend_error"  # the storage back end raised
    LOAD_FAILED = "load_failed"  # the engine was found but would not load
    SAVE_FAILED = "save_failed"  # the compiled engine could not be saved
    UNREFITTABLE = "unrefittable"  # the engine cannot be refit with the current weights

    # -- daemon and CLI ----------------------------------------------------
    DAEMON_ERROR = "daemon_error"  # the daemon or the CLI refused or failed
    ALREADY_RUNNING = "already_running"  # another daemon holds the store's lock
    UNAVAILABLE = "unavailable"  # an optional part (demo, snapshot summary) cannot be imported
    USAGE = "usage"  # the command line itself is wrong (unknown flag, missing argument)

    # -- verify findings ---------------------------------------------------
    QUARANTINED = "quarantined"  # a blob failed verification earlier and sits in quarantine/
    DANGLING_MANIFEST = "dangling_manifest"  # a manifest references a missing or corrupt blob
    NOT_CURRENT = "not_current"  # a committed manifest is not its entry's current generation
    REFCOUNT = "refcount"  # a blob's refcount differs from the manifests referencing it
    STALE_MANIFEST = (
        "stale_manifest"  # an uncommitted manifest older than the grace period, its publisher gone or past its deadline
    )
    TOTALS_DRIFT = "totals_drift"  # the stored physical/logical totals differ from a recount
    STRAY_ROWS = "stray_rows"  # access or shadow rows whose entry or manifest is gone
    ORPHAN_FILES = "orphan_files"  # blob files without an index row
    STALE_TEMPS = "stale_temps"  # temp files left by killed writers
    CORRUPT_RECORD = "corrupt_record"  # an on-disk record does not decode, fails its checksum or names what it may not
    NEWER_RECORD = "newer_record"  # an on-disk record of a newer format than this adstore reads
    MISSING_RECORD = "missing_record"  # a committed manifest has no on-disk record (a rebuild would lose it)
    ORPHAN_RECORDS = "orphan_records"  # on-disk records whose manifest the index no longer has (gc sweeps them)


#: The reasons that name something about the remote tier (its server, what it holds, single-flight
#: builds): a miss for one of them is the remote's doing, not the local store's.
REMOTE_REASONS = frozenset(
    {
        Reason.REMOTE_UNAVAILABLE,
        Reason.REMOTE_TIMEOUT,
        Reason.REMOTE_ERROR,
        Reason.REMOTE_READ_ONLY,
        Reason.REMOTE_UNSUPPORTED,
        Reason.REMOTE_BLOB_MISSING,
        Reason.REMOTE_CHECKSUM,
        Reason.UNTRUSTED_REMOTE,
        Reason.SINGLE_FLIGHT_TIMEOUT,
        Reason.BUILDER_GONE,
    }
)
