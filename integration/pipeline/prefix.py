"""``cached_prefix``: the pipeline cache for a pipeline adstore did not write (docs/pipeline-cache.md, "Public API").

A caller hands over the identity of what it builds (a mapping of named key
components) and a zero-argument ``build`` that returns the pre-weight-loading
module (parameters on the meta device).  The same save/restore protocol as the
``pipeline_cache`` transform runs (:class:`~adstore.integration.pipeline.protocol.SnapshotCache`):
rank agreement when a process group is initialised, generations, commit only
when every rank published, restore only when every rank validated.

Any cache problem is a miss or a bypass with a reason and ``build`` runs;
an exception raised by ``build`` itself propagates, because it is the
caller's error, not the cache's.  Under a process group ``build`` must then
fail on every rank alike, as any collective code must.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from adstore.integration.coordination.dist import Topology, topology
from adstore.integration.coordination.events import CacheEvent, EventKind
from adstore.integration.errors import CacheKeyError
from adstore.integration.pipeline.protocol import NAMESPACE, SnapshotCache
from adstore.integration.validity.keys import CacheKey, canonical, environment_fingerprint, json_digest

__all__ = ["RESERVED_COMPONENTS", "CachedCompile", "CachedPrefix", "cached_prefix", "prefix_key"]

#: Components the cache computes itself; a caller's key may not name them.
RESERVED_COMPONENTS = ("env", "dist")


class _Outcome:
    """``hit`` and ``event`` of a result whose ``events`` say what a cache did, the deciding one last."""

    events: tuple[CacheEvent, ...]

    @property
    def hit(self) -> bool:
        """Whether the result was restored (nothing was built or compiled)."""
        return bool(self.events) and self.events[0].kind == EventKind.HIT

    @property
    def event(self) -> CacheEvent:
        return self.events[-1]


@dataclass(frozen=True)
class CachedPrefix(_Outcome):
    """What :func:`cached_prefix` returns: the module and what the cache did.

    ``events`` are in order: on a hit one ``hit``; otherwise the ``miss`` or
    ``bypass`` of the restore, then the ``save`` (or the ``bypass`` that
    replaced it).  ``event`` is the last, deciding one.  ``key`` is None when
    the key could not be computed.
    """

    module: nn.Module
    events: tuple[CacheEvent, ...]
    key: str | None
    #: The store root the entry lives in (None: the default root).
    root: str | None = None
    #: Digest of the snapshot restored or saved (None when neither happened): what a compile step keys on.
    snapshot: str | None = None

    def compile(
        self,
        module: nn.Module,
        example_inputs: Sequence[Any],
        *,
        key: Mapping[str, Any] | None = None,
        code: Sequence[type | Callable[..., Any]] = (),
        options: Mapping[str, Any] | None = None,
        decompositions: Mapping[Any, Callable[..., Any]] | None = None,
        remote: str | None = None,
    ) -> CachedCompile:
        """``module`` as an AOTInductor engine, found again on a restart from this prefix's key.

        ``module`` is this prefix's module after your own steps (weights
        loaded, fused, ...), ``example_inputs`` what it is called with;
        ``key`` names those steps' configuration and ``code`` their
        functions or classes (source fingerprint), so editing either is a
        miss.  A restart whose prefix hit finds the engine through an index
        entry, refits this run's weights and neither exports nor compiles;
        otherwise it compiles through the engine cache and indexes the
        engine (docs/engine-cache.md).  ``options`` are Inductor options,
        ``decompositions`` custom ops to lower to ATen first, ``remote`` the
        remote tier (default ``ADSTORE_REMOTE``).  A cache problem is a miss
        with a reason and a compile; a compile that fails keeps ``module``
        (a ``bypass``).  A collective under an initialised process group.
        """
        from adstore.integration.engine.stage import EngineStage

        topo = topology()
        prefix = {"key": self.key, "snapshot": self.snapshot} if self.key and self.snapshot else None
        stage = EngineStage(
            root=self.root,
            remote=remote,
            settings=dict(options or {}),
            prefix=prefix,
            suffix=[{"name": "compile", "config": dict(key or {})}],
            code=list(code),
            decompositions=decompositions,
        )
        try:
            out = stage.run(module, tuple(example_inputs), topo)
        finally:
            stage.close()
        index_key = next((e.key for e in stage.events if e.key), None)
        return CachedCompile(module=out, events=tuple(stage.events), key=index_key)


@dataclass(frozen=True)
class CachedCompile(_Outcome):
    """What :meth:`CachedPrefix.compile` returns: the engine (or the module it kept) and what the cache did.

    ``events``: on a hit one ``hit``; otherwise the ``miss`` with its reason,
    then the ``save`` (or the ``bypass`` that kept the eager module).
    """

    module: nn.Module
    events: tuple[CacheEvent, ...]
    key: str | None


def prefix_key(
    key: Mapping[str, Any], *, code: Sequence[type | Callable[..., Any]] = (), topo: Topology | None = None
) -> CacheKey:
    """The cache key of ``key``'s components plus ``env`` (versions, ``code``) and ``dist`` (world size).

    Raises :class:`~adstore.integration.errors.CacheKeyError` when a component
    has no canonical form or names a reserved component.
    """
    if not isinstance(key, Mapping):
        raise CacheKeyError(f"key: expected a mapping of named components, got {type(key).__name__}")
    reserved = sorted(set(map(str, key)) & set(RESERVED_COMPONENTS))
    if reserved:
        raise CacheKeyError(f"key: component(s) {reserved} are computed by the cache; use other names")
    topo = topo or topology()
    components = canonical({**key, "env": environment_fingerprint(code), "dist": {"world_size": topo.world_size}})
    return CacheKey(key=json_digest(components), components=components)


def _fixed_key(
    key: Mapping[str, Any], code: Sequence[Any], topo: Topology
) -> tuple[CacheKey | None, Callable[[], CacheKey]]:
    """The key computed now, before ``build`` can mutate what it hashes, and a getter that raises its error."""
    try:
        value: CacheKey | None = prefix_key(key, code=code, topo=topo)
        error: Exception | None = None
    except Exception as exc:  # reported (fail open) by the protocol
        value, error = None, exc

    def get() -> CacheKey:
        if error is not None:
            raise error
        assert value is not None
        return value

    return value, get


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def cached_prefix(
    key: Mapping[str, Any],
    build: Callable[[], nn.Module],
    *,
    root: str | os.PathLike[str] | None = None,
    namespace: str = NAMESPACE,
    allowed_prefixes: Sequence[str] = (),
    code: Sequence[type | Callable[..., Any]] = (),
    restore: bool = True,
    save: bool = True,
) -> CachedPrefix:
    """The module ``build()`` would return, restored from the store when an entry exists.

    ``key``: named components that identify the module (model identity,
    :func:`checkpoint_fingerprint`, prefix configuration, topology, ...); the
    cache adds ``env`` (:func:`environment_fingerprint` of ``code``: list your
    own passes so editing them is a miss) and ``dist`` (the world size).
    ``allowed_prefixes``: importable prefixes of your own classes and
    functions the snapshot may name.  ``root`` and ``namespace`` choose the
    store and the namespace of the entry; ``restore``/``save`` switch either
    half off (a ``bypass``).  A collective when a process group is
    initialised: every rank calls it at the same point.
    """
    topo = topology()
    cache = SnapshotCache(label="cached_prefix", root=root, namespace=namespace, allowed_prefixes=allowed_prefixes)
    fixed, get_key = _fixed_key(key, code, topo)
    module = cache.restore(get_key, topo, enabled=restore)
    if module is None:
        t0 = time.perf_counter()
        module = build()
        seconds = time.perf_counter() - t0
        if not isinstance(module, nn.Module):
            raise TypeError(f"build() returned {type(module).__name__}, not an nn.Module")
        cache.save(module, get_key, topo, prefix_seconds=seconds, meta={"build": _qualname(build)}, enabled=save)
    return CachedPrefix(
        module=module,
        events=tuple(cache.events),
        key=fixed.key if fixed is not None else None,
        root=None if root is None else os.fspath(root),
        snapshot=cache.snapshot,
    )
