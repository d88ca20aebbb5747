"""Errors of the torch-side integration, under the one adstore hierarchy.

``reason`` on each class is the named reason of the miss or bypass that the
cache reports when it catches the error (the cache fails open).
"""

from __future__ import annotations

from adstore.store import AdstoreError, ConfigError, Reason

__all__ = [
    "IntegrationError",
    "SnapshotError",
    "UnsupportedModule",
    "UnsupportedHook",
    "ForwardHookPresent",
    "MaterializedParameters",
    "UntrustedTarget",
    "CorruptSnapshot",
    "CacheKeyError",
    "IncompatibleEnv",
    "EngineCacheError",
    "InputMismatch",
    "CorruptEngine",
    "TruncatedEngine",
    "EngineMismatch",
    "EngineUnavailable",
    "UntrustedEngine",
    "RemoteEngineMiss",
    "InductorCacheError",
    "UntrustedKernel",
    "CorruptKernel",
    "UnsafeCacheDir",
    "VllmTreeError",
    "ConfigError",
    "failure_reason",
]


class IntegrationError(AdstoreError):
    reason = Reason.INTEGRATION_ERROR


class SnapshotError(IntegrationError):
    """A module cannot be snapshotted or a snapshot cannot be restored."""

    reason = Reason.SNAPSHOT_ERROR

    def __init__(self, message: str, *, detail: object = None) -> None:
        self.detail = detail
        super().__init__(message)


class UnsupportedModule(SnapshotError):
    reason = Reason.UNSUPPORTED_MODULE


class UnsupportedHook(SnapshotError):
    reason = Reason.UNSUPPORTED_HOOK


class ForwardHookPresent(SnapshotError):
    reason = Reason.FORWARD_HOOK


class MaterializedParameters(SnapshotError):
    """Parameters hold real data: the module is past weight loading."""

    reason = Reason.MATERIALIZED_PARAMETERS

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        shown = ", ".join(self.names[:5]) + (" …" if len(self.names) > 5 else "")
        super().__init__(f"module has materialized (non-meta) parameters: {shown}", detail=self.names)


class UntrustedTarget(SnapshotError):
    """A payload names a callable or class outside the allow-list; nothing was called."""

    reason = Reason.UNTRUSTED_TARGET

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname
        super().__init__(f"snapshot names {qualname!r}, which is outside the allowed prefixes")


class CorruptSnapshot(SnapshotError):
    reason = Reason.CORRUPT_SNAPSHOT


class CacheKeyError(IntegrationError):
    reason = Reason.KEY_ERROR


class IncompatibleEnv(IntegrationError):
    """An entry for this request exists but was built in another environment; it is not loaded.

    ``fields`` are the dotted names of the environment fields that differ
    (``env.torch``, ``toolchain.cpu.capability``), so the miss says what to fix.
    """

    reason = Reason.INCOMPATIBLE_ENV

    def __init__(self, fields: list[str], message: str) -> None:
        self.fields = list(fields)
        super().__init__(message)


class EngineCacheError(IntegrationError):
    reason = Reason.ENGINE_ERROR


class CorruptEngine(EngineCacheError):
    reason = Reason.CORRUPT_ENGINE


class TruncatedEngine(CorruptEngine):
    """A stored engine record is shorter than its header says."""

    reason = Reason.TRUNCATED_ENGINE


class EngineMismatch(EngineCacheError):
    """A stored engine is intact but does not fit this request (hash, format, constants, spec)."""

    reason = Reason.ENGINE_MISMATCH

    def __init__(self, what: str, message: str) -> None:
        self.what = what
        super().__init__(f"engine {what} mismatch: {message}")


class InputMismatch(EngineMismatch, TypeError):
    """A call of an engine with inputs other than those it was compiled for (a size, a dtype, another scalar).

    The engine would read them as the compiled ones and answer wrongly, so it
    refuses the call instead; compile for these inputs (docs/engine-cache.md,
    "How a compiled stage is called").
    """

    def __init__(self, message: str) -> None:
        super().__init__("inputs", message)


class EngineUnavailable(EngineCacheError):
    """The backend has the engine's key but cannot serve it (e.g. the store said blob_missing)."""

    reason = Reason.ENGINE_UNAVAILABLE

    def __init__(self, key: str, store_reason: str | None) -> None:
        self.key = key
        self.store_reason = store_reason
        super().__init__(f"engine {key} unavailable: {store_reason}")


class UntrustedEngine(EngineCacheError):
    """A stored engine was written by a user this process does not trust; it is native code, so it is not loaded."""

    reason = Reason.UNTRUSTED_ENGINE

    def __init__(self, key: str, owner: int | None, detail: str) -> None:
        self.key = key
        self.owner = owner
        super().__init__(f"engine {key} not loaded: {detail}")


class RemoteEngineMiss(EngineCacheError):
    """Not in the local store, and the remote tier did not supply it; ``reason`` is the remote's.

    ``untrusted_remote`` among them: an engine is native code, so one from an
    unsigned or untrusted record is never even committed locally, let alone loaded.
    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = Reason(reason)
        super().__init__(f"engine {key} not restored from the remote tier: {reason}")


class InductorCacheError(IntegrationError):
    """Inductor's caches through adstore (``adstore.integration.inductor``) could not serve or keep an entry.

    Never raised into ``torch.compile``: the adapter catches it, counts
    ``inductor.failopen.<reason>`` and Inductor compiles as it would without adstore.
    """


class UntrustedKernel(InductorCacheError):
    """A cache entry's file (a kernel, a pickled graph, a header) comes from a writer this process does not trust.

    These files become code, so the engine cache's rule applies: only blob
    files owned by this user, root or ``ADSTORE_TRUSTED_UIDS``, and inline
    blobs only from an index no other user can write.
    """

    reason = Reason.UNTRUSTED_ENGINE

    def __init__(self, digest: str, detail: str) -> None:
        self.digest = digest
        super().__init__(f"blob {digest[:12]} not loaded: {detail}")


class CorruptKernel(InductorCacheError):
    """A blob read for Inductor did not hash to its digest (or did not decode); it was quarantined."""

    reason = Reason.CHECKSUM

    def __init__(self, digest: str, got: str, size: int) -> None:
        self.digest = digest
        self.got = got
        self.size = size
        super().__init__(f"blob {digest[:12]}: content hashes to {got[:12]} ({size} bytes)")


class UnsafeCacheDir(InductorCacheError):
    """A directory files would be placed in is not this user's alone (another owner, group or world writable)."""

    reason = Reason.UNSAFE_ROOT

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        super().__init__(f"{path}: {detail}")


class VllmTreeError(IntegrationError):
    """A directory tree of vLLM's compile artifacts could not be captured or restored.

    Never raised into vLLM: :mod:`adstore.integration.vllm.trees` turns it into
    an outcome (a miss, a refused capture) whose reason is ``why``
    (``unsupported_file``, ``unsafe_path``, ``corrupt_tree``, ...), so the log
    and the counters say what was wrong with which file.
    """

    def __init__(self, why: str, message: str) -> None:
        self.why = why
        super().__init__(message)


def failure_reason(exc: BaseException, default: Reason = Reason.INTEGRATION_ERROR) -> str:
    """The reason a fail-open counts for ``exc``: the one mapping from an exception to a reason.

    A :class:`VllmTreeError`'s ``why``; else the exception's own ``reason``
    when it names one of :class:`~adstore.store.Reason`; else ``io_error``
    for an ``OSError``; else ``default``.
    """
    if isinstance(exc, VllmTreeError):
        return exc.why
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason in Reason._value2member_map_:
        return str(Reason(reason))
    if isinstance(exc, OSError):
        return str(Reason.IO_ERROR)
    return str(default)
