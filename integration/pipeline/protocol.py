"""The save/restore protocol of a cached pipeline prefix, shared by every entry point.

Both the ``pipeline_cache`` transform and :func:`~adstore.integration.cached_prefix`
run this one implementation (docs/pipeline-cache.md, "Public API"),
so rank agreement, generations, commit, events and fail-open handling exist once.

Save (every rank, same collective sequence): agree on rank 0's generation;
snapshot, put the blobs and publish this rank's manifest uncommitted; agree
that every rank succeeded; only then commit (else abort).  Restore: each rank
looks up and validates its own manifest; agree on success and on one
generation; load the snapshot and reattach its hooks; agree again.  A failure
anywhere on any rank makes every rank run the full pipeline, and nothing
partial is ever restorable: the store only serves an entry whose ranks all
committed the same generation.

A lookup that finds no entry but an entry for the same request saved in
another environment (torch, Python ABI, ...) is the miss ``incompatible_env``
naming the differing fields (:mod:`~adstore.integration.validity.envcheck`).

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from adstore.integration.coordination import dist as agree
from adstore.integration.coordination.dist import Topology
from adstore.integration.coordination.events import CacheEvent, EventKind, Source
from adstore.integration.errors import failure_reason
from adstore.integration.validity.envcheck import find_mismatch, store_candidates
from adstore.integration.validity.keys import CacheKey, json_digest
from adstore.store import AdstoreError, Reason, trusted_uids

__all__ = ["NAMESPACE", "SnapshotCache", "snapshot_digest"]

log = logging.getLogger(__name__)

#: The store namespace pipeline prefixes are saved under unless the caller names another.
NAMESPACE = "pipeline"


def snapshot_digest(artifacts: Mapping[str, Any]) -> str:
    """The identity of one rank's snapshot: a digest over its artifacts' names and content digests."""
    return json_digest({str(name): ref.digest for name, ref in artifacts.items()})


class SnapshotCache:
    """Restore or save one module snapshot under one key, with rank agreement and events.

    ``key`` arguments are zero-argument callables so that a key which cannot be
    computed is a reasoned miss/bypass on this rank while the collectives still
    run on every rank.  ``events`` collects what happened, in order.
    """

    def __init__(
        self,
        *,
        label: str,
        root: str | os.PathLike[str] | None = None,
        namespace: str = NAMESPACE,
        allowed_prefixes: Sequence[str] = (),
    ) -> None:
        self.label = label
        self.root = root
        self.namespace = namespace
        self.allowed_prefixes = tuple(allowed_prefixes)
        self.events: list[CacheEvent] = []
        #: Digest of this rank's snapshot restored or saved last (its artifacts' digests); None before either.
        #: Stages after the point key what they cache by it (the compile stage's engine index).
        self.snapshot: str | None = None
        self._store: Any = None
        self._key: str | None = None

    def store(self) -> Any:
        """The store at ``root`` (opened on first use; an error here is a reasoned miss/bypass).

        Without a ``root``, the store the environment names, its seed
        (``ADSTORE_SEED``) and budget included, as every other tier opens
        it; the remote tier is the pipeline's own (:mod:`adstore.integration.coordination.remote`), not the store's.
        """
        if self._store is None:
            from adstore.store import Store

            self._store = Store.open(self.root) if self.root is not None else Store.from_env(remote=None)
        return self._store

    def _compute_key(self, key: Callable[[], CacheKey]) -> CacheKey:
        ck = key()
        self._key = ck.key
        return ck

    def _event(
        self,
        kind: EventKind,
        topo: Topology,
        *,
        reason: Reason | None = None,
        source: Source = Source.NONE,
        seconds: float = 0.0,
        seconds_saved: float = 0.0,
        nbytes: int = 0,
        detail: str = "",
    ) -> CacheEvent:
        ev = CacheEvent(
            kind,
            reason=reason,
            key=self._key,
            source=source,
            rank=topo.rank,
            world_size=topo.world_size,
            seconds=seconds,
            seconds_saved=seconds_saved,
            bytes=nbytes,
            detail=detail,
        )
        self.events.append(ev)
        log.info(
            "%s %s%s (rank %d/%d, %.3fs)%s",
            self.label,
            kind,
            f" [{reason}]" if reason else "",
            topo.rank,
            topo.world_size,
            seconds,
            f": {detail}" if detail else "",
        )
        if self._store is not None:
            try:
                self._store.count_event(kind, reason, seconds_saved=max(0.0, seconds_saved))
                self._store.flush()
            except Exception as exc:  # counting must never break the pipeline
                log.warning("could not record cache event: %s", exc)
        return ev

    # -------------------------------------------------------------- restore
    def restore(self, key: Callable[[], CacheKey], topo: Topology, *, enabled: bool = True) -> nn.Module | None:
        """The restored module on a hit on every rank, else None (run the prefix).

        The entry is leased from before the lookup until the blobs are read, so
        an eviction in between (the daemon, `adstore gc`) skips it instead of
        turning the hit into a ``blob_missing`` miss.
        """
        if not enabled:
            self._event(EventKind.BYPASS, topo, reason=Reason.RESTORE_DISABLED)
            return None
        with contextlib.ExitStack() as leases:
            return self._restore(key, topo, leases)

    def _restore(self, key: Callable[[], CacheKey], topo: Topology, leases: contextlib.ExitStack) -> nn.Module | None:
        t0 = time.perf_counter()
        ok, reason, gen, manifest, detail = False, None, None, None, ""
        try:
            ck = self._compute_key(key)
            text = ck.key
            try:
                leases.enter_context(self.store().lease(text))
            except AdstoreError as exc:  # no lease (e.g. a full disk): restore unprotected
                log.debug("no lease on %s: %s", text, exc)
            # Sealed: a group member who re-points the key at another entry's blobs is a miss (unsealed_entry).
            rank = topo.rank if topo.world_size > 1 else None
            res = self.store().lookup(text, rank=rank, count=False, trusted=trusted_uids())
            if res.hit:
                manifest = res.manifest if res.manifest is not None else res.manifests.get(topo.rank)
                ok = manifest is not None and manifest.world_size == topo.world_size
                reason = None if ok else Reason.TOPOLOGY_MISMATCH
                gen = res.generation if ok else None
            else:
                reason = res.reason or Reason.ABSENT
                if reason == Reason.ABSENT:
                    reason, detail = self._why_absent(ck)
        except Exception as exc:
            reason, detail = Reason(failure_reason(exc, Reason.ERROR)), str(exc)
        # agreement 1: every rank found its own committed manifest of one generation
        all_ok = agree.all_true(ok)
        common = agree.agree_int(gen if ok else None)
        if not all_ok or common is None:
            if ok:
                reason = Reason.PEER_MISS if not all_ok else Reason.GENERATION_MISMATCH
            self._event(EventKind.MISS, topo, reason=reason, seconds=time.perf_counter() - t0, detail=detail)
            return None
        module = None
        try:
            assert manifest is not None
            from adstore.integration.snapshot import load_module

            artifacts = {name: self.store().read_artifact(manifest, name) for name in manifest.artifacts}
            module = load_module(artifacts, allowed_prefixes=self.allowed_prefixes)
        except Exception as exc:
            reason, detail = Reason(failure_reason(exc, Reason.ERROR)), str(exc)
            module = None
        # agreement 2: every rank loaded and reattached its hooks
        if not agree.all_true(module is not None):
            self._event(
                EventKind.MISS,
                topo,
                reason=reason or Reason.PEER_RESTORE_FAILED,
                seconds=time.perf_counter() - t0,
                detail=detail,
            )
            return None
        seconds = time.perf_counter() - t0
        self.snapshot = snapshot_digest(manifest.artifacts)
        saved = float(manifest.meta.get("prefix_seconds", 0.0)) - seconds
        self._event(
            EventKind.HIT,
            topo,
            source=Source.STORE,
            seconds=seconds,
            seconds_saved=saved,
            nbytes=sum(ref.size for ref in manifest.artifacts.values()),
        )
        return module

    def _why_absent(self, ck: CacheKey) -> tuple[Reason, str]:
        """``incompatible_env`` naming the fields when this request was saved in another environment.

        Only names the reason: the entry found has another key and is never loaded.
        """
        try:
            found = find_mismatch(
                store_candidates(self.store(), self.namespace, exclude=ck.key),
                ck.components,
                env=("env",),
                request=("env.code",),
            )  # edited prefix code: another request
        except Exception as exc:  # the diagnosis must never fail the lookup
            log.debug("no environment diagnosis for %s: %s", ck.key, exc)
            return Reason.ABSENT, ""
        if found is None:
            return Reason.ABSENT, ""
        return Reason.INCOMPATIBLE_ENV, found.message()

    # ----------------------------------------------------------------- save
    def save(
        self,
        module: nn.Module,
        key: Callable[[], CacheKey],
        topo: Topology,
        *,
        prefix_seconds: float,
        meta: Mapping[str, Any] | None = None,
        enabled: bool = True,
    ) -> bool:
        """Save ``module`` on every rank (a collective); True when every rank committed.

        ``prefix_seconds`` (what producing the module took) is stored with the
        entry so a later hit can report the seconds it saved; ``meta`` is
        stored beside it for ``adstore inspect``.
        """
        if not enabled:
            self._event(EventKind.BYPASS, topo, reason=Reason.SAVE_DISABLED)
            return False
        t0 = time.perf_counter()
        reason, detail, kind = None, "", EventKind.BYPASS
        nbytes, gen, ck, store = 0, 0, None, None
        refs: dict[str, Any] = {}
        try:
            ck = self._compute_key(key)
            store = self.store()
            local_gen = store.new_generation() if topo.rank == 0 else 0
        except Exception as exc:
            reason, detail, local_gen = Reason(failure_reason(exc, Reason.ERROR)), str(exc), 0
        # agreement 0: rank 0's generation for every rank (0 = rank 0 cannot save)
        gen = agree.broadcast_int(local_gen)

        def snapshot() -> dict[str, Any]:
            from adstore.integration.snapshot import dump_module

            refs.update({name: store.put_bytes(data) for name, data in dump_module(module).items()})
            return refs

        if ck is not None and reason is None and gen > 0:
            # agreement 1 (inside the store's one publish path): every rank published; only then commit
            try:
                saved = store.save(
                    ck.key,
                    snapshot,
                    rank=topo.rank,
                    world_size=topo.world_size,
                    generation=gen,
                    namespace=self.namespace,
                    components=ck.components,
                    meta={
                        "prefix_seconds": prefix_seconds,
                        **(meta or {}),
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                    },
                    agree=agree.all_true,
                )
                if saved is None:
                    reason = Reason.PEER_SAVE_FAILED
                else:
                    kind = EventKind.SAVE
                    self.snapshot = snapshot_digest(refs)
            except Exception as exc:
                reason, detail = Reason(failure_reason(exc, Reason.ERROR)), str(exc)
        else:
            reason = reason or Reason.PEER_SAVE_FAILED
            agree.all_true(False)  # agreement 1, joined by a rank that has nothing to publish
        nbytes = sum(r.size for r in refs.values())
        # agreement 2: every rank committed (a lone commit is never restorable anyway)
        if not agree.all_true(kind == EventKind.SAVE) and kind == EventKind.SAVE:
            kind, reason = EventKind.BYPASS, Reason.PEER_COMMIT_FAILED
        self._event(
            kind,
            topo,
            reason=reason if kind != EventKind.SAVE else None,
            seconds=time.perf_counter() - t0,
            nbytes=nbytes,
            detail=detail,
        )
        return kind == EventKind.SAVE
