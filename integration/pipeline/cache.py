"""The ``pipeline_cache`` transform: snapshot at the cache point, restore before the prefix.

It is a transform like any other, placed at or before the sharding stage.  The
optimizer hands it a copy of the prefix configs taken before any transform ran
(so a transform that mutates its config does not change the key), asks it to
restore first, and on a miss runs the prefix and then calls :meth:`apply`,
which saves.

Save (every rank, same collective sequence): agree on rank 0's generation;
snapshot, put the blobs and publish this rank's manifest uncommitted; agree
that every rank succeeded; only then commit (else abort).  Restore: each rank
looks up and validates its own manifest; agree on success and on one
generation; load the snapshot and reattach its hooks; agree again.  A failure
anywhere on any rank makes every rank run the full pipeline, and nothing
partial is ever restorable: the store only serves an entry whose ranks all
committed the same generation.

Everything fails open: key computation, opening the root, IO, corrupt or
untrusted payloads, unsupported modules and hooks each become a ``miss`` or a
``bypass`` event with a reason, counted in the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from adstore.integration.pipeline import dist as agree
from adstore.integration.pipeline import remote as remote_tier
from adstore.integration.pipeline.events import CacheEvent, EventKind, Source
from adstore.integration.pipeline.keys import CacheKey, build_key, env_component
from adstore.integration.pipeline.transforms import PipelineContext, Stage, Transform, TransformConfig
from adstore.integration.reference.checkpoint import checkpoint_fingerprint
from adstore.store.errors import AdstoreError, ConfigError
from adstore.store.reasons import Reason
from torch import nn

__all__ = ["NAMESPACE", "PipelineCache", "PipelineCacheConfig"]

log = logging.getLogger(__name__)

NAMESPACE = "pipeline"


@dataclass(kw_only=True)
class PipelineCacheConfig(TransformConfig):
    """``stage``: where the cache point sits (end of that stage, at most ``sharding``).

    ``root``: store root (None = ``$ADSTORE_ROOT`` or the XDG cache dir);
    ``extra``: caller data hashed into the key; ``allowed_prefixes``: extra
    importable prefixes a snapshot may name (your own wrapper classes).
    """

    stage: str = "sharding"
    root: str | None = None
    namespace: str = NAMESPACE
    extra: dict = field(default_factory=dict)
    allowed_prefixes: list[str] = field(default_factory=list)
    restore: bool = True
    save: bool = True
    remote: str | None = None  # the remote tier's URL; None: $ADSTORE_REMOTE when the pipeline runs

    def validate(self, owner: str) -> None:
        stage = Stage.parse(self.stage)
        if stage > Stage.SHARDING:
            raise ConfigError(
                f"{owner}.stage",
                f"the cache point must sit at or before sharding and before weight loading, not {stage.name.lower()}",
            )


def _reason(exc: BaseException) -> Reason:
    """The reason an error becomes: its own ``reason`` if it names one, else by kind."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        with contextlib.suppress(ValueError):
            return Reason(reason)
    if isinstance(exc, OSError):
        return Reason.IO_ERROR
    return Reason.ERROR


class PipelineCache(Transform):
    """Snapshot the pre-weight-loading module on a miss; restore it on a hit.

    The optimizer drives it through the :class:`~adstore.integration.pipeline.transforms.CachePoint`
    protocol: :meth:`bind`, :meth:`restore`, :meth:`save`.
    """

    name = "pipeline_cache"
    stage = Stage.SHARDING
    config_cls = PipelineCacheConfig

    def __init__(self, config: TransformConfig) -> None:
        super().__init__(config)
        self.events: list[CacheEvent] = []
        self._prefix: list[dict[str, Any]] = []
        self._prefix_classes: list[type] = []
        self._reaches_sharding = False
        self._key: CacheKey | None = None
        self._store: Any = None

    @property
    def cfg(self) -> PipelineCacheConfig:
        return self.config  # type: ignore[return-value]

    @property
    def cache_stage(self) -> Stage:
        return Stage.parse(self.cfg.stage)

    # ------------------------------------------------------------- plumbing
    def bind(self, prefix: Sequence[tuple[str, dict[str, Any]]], prefix_classes: Sequence[type]) -> None:
        """Receive the prefix (names + config copies taken before any transform ran)."""
        self._prefix = [{"name": n, "config": c} for n, c in prefix]
        self._prefix_classes = list(prefix_classes)
        self._reaches_sharding = any(getattr(c, "stage", 0) >= Stage.SHARDING for c in prefix_classes)
        self._key = None

    def key(self, ctx: PipelineContext) -> CacheKey:
        """The cache key of this run (computed once)."""
        if self._key is None:
            self._key = build_key(
                model=ctx.factory.identity(),
                checkpoint=checkpoint_fingerprint(ctx.checkpoint),
                prefix=self._prefix,
                dist={"world_size": ctx.world_size} if self._reaches_sharding else None,
                env=env_component(self._prefix_classes),
                extra=self.cfg.extra,
            )
        return self._key

    def store(self) -> Any:
        if self._store is None:
            from adstore.store import Store

            self._store = Store.open(self.cfg.root)
        return self._store

    def _event(self, kind: EventKind, ctx: PipelineContext, *, reason: Reason | None = None,
               source: Source = Source.NONE, seconds: float = 0.0, seconds_saved: float = 0.0, nbytes: int = 0,
               detail: str = "") -> CacheEvent:
        ev = CacheEvent(kind, reason=reason, key=self._key.key if self._key else None, source=source,
                        rank=ctx.rank, world_size=ctx.world_size, seconds=seconds, seconds_saved=seconds_saved,
                        bytes=nbytes, detail=detail)
        self.events.append(ev)
        log.info("pipeline_cache %s%s (rank %d/%d, %.3fs)%s", kind, f" [{reason}]" if reason else "",
                 ctx.rank, ctx.world_size, seconds, f": {detail}" if detail else "")
        if self._store is not None:
            try:
                self._store.record(kind, reason, seconds_saved=max(0.0, seconds_saved))
                self._store.flush()
            except Exception as exc:  # counting must never break the pipeline
                log.warning("could not record cache event: %s", exc)
        return ev

    # -------------------------------------------------------------- restore
    def restore(self, ctx: PipelineContext) -> nn.Module | None:
        """The restored module on a hit on every rank, else None (full pipeline).

        The entry is leased from before the lookup until the blobs are read, so
        an eviction in between (the daemon, `adstore gc`) skips it instead of
        turning the hit into a ``blob_missing`` miss.
        """
        fetched = remote_tier.prefetch(self, ctx)  # a local miss restored from the remote tier
        with contextlib.ExitStack() as leases:
            return remote_tier.mark(self, fetched, self._restore(ctx, leases))

    def _restore(self, ctx: PipelineContext, leases: contextlib.ExitStack) -> nn.Module | None:
        t0 = time.perf_counter()
        if not (self.cfg.enabled and self.cfg.restore):
            self._event(EventKind.BYPASS, ctx, reason=Reason.RESTORE_DISABLED)
            return None
        ok, reason, gen, manifest, detail = False, None, None, None, ""
        try:
            key = self.key(ctx).key
            try:
                leases.enter_context(self.store().lease(key))
            except AdstoreError as exc:  # no lease (e.g. a full disk): restore unprotected
                log.debug("no lease on %s: %s", key, exc)
            res = self.store().lookup(key, rank=ctx.rank if ctx.world_size > 1 else None, record=False)
            if res.hit:
                manifest = res.manifest if res.manifest is not None else res.manifests.get(ctx.rank)
                ok = manifest is not None and manifest.world_size == ctx.world_size
                reason = None if ok else Reason.TOPOLOGY_MISMATCH
                gen = res.generation if ok else None
            else:
                reason = res.reason or Reason.ABSENT
        except Exception as exc:
            reason, detail = _reason(exc), str(exc)
        # agreement 1: every rank found its own committed manifest of one generation
        all_ok = agree.all_true(ok)
        common = agree.agree_int(gen if ok else None)
        if not all_ok or common is None:
            if ok:
                reason = Reason.PEER_MISS if not all_ok else Reason.GENERATION_MISMATCH
            self._event(EventKind.MISS, ctx, reason=reason, seconds=time.perf_counter() - t0, detail=detail)
            return None
        module = None
        try:
            assert manifest is not None
            from adstore.integration.snapshot import load_module

            artifacts = {name: self.store().read_artifact(manifest, name) for name in manifest.artifacts}
            module = load_module(artifacts, allowed_prefixes=tuple(self.cfg.allowed_prefixes))
        except Exception as exc:
            reason, detail = _reason(exc), str(exc)
            module = None
        # agreement 2: every rank loaded and reattached its hooks
        if not agree.all_true(module is not None):
            self._event(EventKind.MISS, ctx, reason=reason or Reason.PEER_RESTORE_FAILED,
                        seconds=time.perf_counter() - t0, detail=detail)
            return None
        seconds = time.perf_counter() - t0
        saved = float(manifest.meta.get("prefix_seconds", 0.0)) - seconds
        self._event(EventKind.HIT, ctx, source=Source.STORE, seconds=seconds, seconds_saved=saved,
                    nbytes=sum(ref.size for ref in manifest.artifacts.values()))
        return module

    # ----------------------------------------------------------------- save
    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        """Run as a plain transform: :meth:`save` without a prefix time."""
        return self.save(module, ctx, prefix_seconds=0.0)  # type: ignore[arg-type]

    def save(self, module: nn.Module, ctx: PipelineContext, *, prefix_seconds: float) -> nn.Module:
        """Save ``module`` at the cache point (on a miss); returns it unchanged.

        ``prefix_seconds`` (what the prefix took) is stored with the entry, so a
        later hit can report the seconds it saved.
        """
        if module is None:
            return module  # type: ignore[return-value]
        if not self.cfg.save:
            self._event(EventKind.BYPASS, ctx, reason=Reason.SAVE_DISABLED)
            return module
        t0 = time.perf_counter()
        ok, reason, detail, kind = False, None, "", EventKind.BYPASS
        published, nbytes, gen, key = False, 0, 0, None
        try:
            key = self.key(ctx)
            store = self.store()
            local_gen = store.new_generation() if ctx.rank == 0 else 0
        except Exception as exc:
            reason, detail, local_gen = _reason(exc), str(exc), 0
        # agreement 0: rank 0's generation for every rank (0 = rank 0 cannot save)
        gen = agree.broadcast_int(local_gen)
        if key is not None and reason is None:
            if gen <= 0:
                reason = Reason.PEER_SAVE_FAILED
            else:
                try:
                    from adstore.integration.snapshot import dump_module

                    artifacts = dump_module(module)
                    refs = {name: store.put_bytes(data) for name, data in artifacts.items()}
                    nbytes = sum(r.size for r in refs.values())
                    store.publish(
                        key.key, rank=ctx.rank, world_size=ctx.world_size, generation=gen,
                        artifacts=refs, namespace=self.cfg.namespace, components=key.components,
                        meta={"prefix_seconds": prefix_seconds,
                              "transforms": [p["name"] for p in self._prefix],
                              "host": socket.gethostname(), "pid": os.getpid()},
                    )
                    published, ok = True, True
                except Exception as exc:
                    reason, detail = _reason(exc), str(exc)
        # agreement 1: every rank published; only then commit
        if agree.all_true(ok):
            try:
                store.commit(key.key, rank=ctx.rank, generation=gen)  # type: ignore[union-attr]
                kind = EventKind.SAVE
            except Exception as exc:
                reason, detail = _reason(exc), str(exc)
                try:  # leave nothing uncommitted behind (gc would sweep it only later)
                    store.abort(key.key, rank=ctx.rank, generation=gen)  # type: ignore[union-attr]
                except Exception as abort_exc:
                    log.warning("abort of uncommitted manifest failed: %s", abort_exc)
        else:
            reason = reason or Reason.PEER_SAVE_FAILED
            if published:
                try:
                    store.abort(key.key, rank=ctx.rank, generation=gen)  # type: ignore[union-attr]
                except Exception as exc:  # gc sweeps an uncommitted manifest later
                    log.warning("abort of uncommitted manifest failed: %s", exc)
        # agreement 2: every rank committed (a lone commit is never restorable anyway)
        if not agree.all_true(kind == EventKind.SAVE) and kind == EventKind.SAVE:
            kind, reason = EventKind.BYPASS, Reason.PEER_COMMIT_FAILED
        self._event(kind, ctx, reason=reason if kind != EventKind.SAVE else None, seconds=time.perf_counter() - t0,
                    nbytes=nbytes, detail=detail)
        remote_tier.push(self, ctx)
        return module
