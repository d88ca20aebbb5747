"""The one publish path: publish a rank's manifest, commit it, abort it on any failure.

Every save of the store goes through :meth:`Publisher.save`: the pipeline
cache (ranks agreeing between the publish and the commit), the engine
cache, the compile stage's entries and a restore from the remote tier.  A
failure anywhere between the first write and the commit drops what was
published, in this one place, so a fix to that sequence lands once
(docs/architecture.md, "How an entry lives").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .index.rows import BlobRef, Manifest, validate_json
from .index.tables import Tables, Txn
from .leases import DEFAULT_PUBLISH_TIMEOUT
from .manifests import FileCheck, abort, commit, publish, validate_publish
from .names import validate_key
from .records.sync import RecordInputs, RecordWriter, components_changed, record_inputs

__all__ = ["Artifacts", "Publisher"]

log = logging.getLogger(__name__)

#: A save's blobs: stored already, or a function storing them (its failure is the saving rank's).
Artifacts = Mapping[str, BlobRef] | Callable[[], Mapping[str, BlobRef]]


class Publisher:
    """Publish, commit and abort manifests: the index rows and the records beside them (invariant 9).

    ``pushed(key, rank)`` runs after each commit (the remote tier's push).
    """

    def __init__(
        self,
        tables: Tables,
        records: RecordWriter,
        file_ok: FileCheck,
        *,
        pushed: Callable[[str, int], object],
        publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT,
    ) -> None:
        self._tables = tables
        self._timeout = publish_timeout  # how long gc waits for a commit while this process runs
        self._records = records
        self._file_ok = file_ok
        self._pushed = pushed

    def save(
        self,
        key: str,
        artifacts: Artifacts,
        *,
        generation: int,
        rank: int = 0,
        world_size: int = 1,
        namespace: str = "default",
        components: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        agree: Callable[[bool], bool] | None = None,
        commit: bool = True,
        vet: Callable[[Mapping[str, BlobRef]], str | None] | None = None,
    ) -> Manifest | None:
        """Publish this rank's manifest (index row, then record), then commit it; see ``Store.save``.

        Once anything is published, a failure aborts it before the error is
        raised (an abort that fails too is logged: gc sweeps the manifest past
        the grace period).  ``agree`` is called exactly once, whatever
        happened here, so no peer waits in vain; when it says no, the
        manifest is aborted and None returned.  ``vet(refs)``: why these blobs must not be
        published (nothing is, None returned, and ``agree`` told this rank did not publish).
        """
        published = done = False
        failure: Exception | None = None
        manifest: Manifest | None = None
        refused: str | None = None
        try:
            try:
                refs = artifacts() if callable(artifacts) else artifacts
                refused = vet(refs) if vet is not None else None
                if refused is None:
                    manifest, inputs = self._rows(key, refs, rank, world_size, generation, namespace, components, meta)
                    published = True
                    self._records.published(manifest, inputs)  # no record, no commit: the save fails whole
            except Exception as exc:
                failure = exc
            agreed = agree(failure is None and refused is None) if agree is not None else True
            if failure is not None:
                raise failure
            if not agreed or refused is not None:
                return None
            if commit:
                manifest = self.commit(key, rank=rank, generation=generation, components=components)
            done = True
            return manifest
        finally:
            if published and not done:
                try:
                    self.abort(key, rank=rank, generation=generation)
                except Exception as exc:  # the save's own failure is what its caller hears
                    log.warning(
                        "abort of %s rank %d generation %d failed (gc sweeps it): %s", key, rank, generation, exc
                    )

    def _rows(
        self,
        key: str,
        refs: Mapping[str, BlobRef],
        rank: int,
        world_size: int,
        generation: int,
        namespace: str,
        components: Mapping[str, Any] | None,
        meta: Mapping[str, Any] | None,
    ) -> tuple[Manifest, RecordInputs]:
        """The manifest's index row, its blobs' refcounts held in the same transaction; what its record needs."""
        validate_publish(
            key,
            rank=rank,
            world_size=world_size,
            generation=generation,
            artifacts=refs,
            namespace=namespace,
            components=components,
            meta=meta,
        )

        def fn(t: Txn) -> tuple[Manifest, RecordInputs]:
            m = publish(
                t,
                key=key,
                rank=rank,
                world_size=world_size,
                generation=generation,
                artifacts=refs,
                namespace=namespace,
                components=components or {},
                meta=meta or {},
                file_ok=self._file_ok,
                timeout=self._timeout,
            )
            return m, record_inputs(t, m)

        return self._tables.write(fn)

    def commit(
        self, key: str, *, rank: int = 0, generation: int, components: Mapping[str, Any] | None = None
    ) -> Manifest:
        """Make a published manifest restorable; releases the rank's older generation."""
        validate_key(key)
        validate_json(components or {}, "components")

        def fn(t: Txn) -> tuple[Manifest, bool]:
            changed = components_changed(t, key, components)
            return commit(t, key=key, rank=rank, generation=generation, components=components)[0], changed

        (manifest, rewrite), drops = self._tables.write_noting_drops(fn)
        self._records.committed(key, rank, generation, rewrite=rewrite, drops=drops)
        self._pushed(key, rank)
        return manifest

    def abort(self, key: str, *, rank: int = 0, generation: int) -> bool:
        """Drop an uncommitted manifest (a failed save); returns whether one was dropped."""
        validate_key(key)
        return self._tables.write(lambda t: abort(t, key=key, rank=rank, generation=generation))
