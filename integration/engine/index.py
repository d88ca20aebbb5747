"""The engine index: which engine a compile stage uses, found from what already determines its graph.

An engine's identity is the hash of its graph (:mod:`~adstore.integration.engine.hashing`),
and computing it means exporting the module and walking its graph: seconds
of a restart, plus the imports of dynamo.  A compile stage that runs after a
pipeline's cache point knows its graph without looking at it: the prefix's
cache key fixes the module at the point, the configuration and source of
every transform after the point fix what they do to it (every transform is
deterministic), and the example inputs, the Inductor settings and the
toolchain fix the code.  The index maps a key over exactly those to the
engine hash the cold run compiled (docs/engine-cache.md, "The index: found from the pipeline's key").

An index entry lives in the store (namespace ``engine_index``, one small
JSON artifact) beside the engine it names (namespace ``engine``), with the
store's LRU, budget and remote tier.  It also keeps the digests of the graph,
input, settings and toolchain components of that engine's hash: a record
found under the hash whose digests differ is not the engine the cold run
stored (``engine_mismatch``), never a wrong engine.  The index key's
components are stored with the entry, so a miss whose request was indexed
in another environment (another CPU ISA) names the field
(``incompatible_env``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adstore.integration.engine.hashing import HASH_VERSION
from adstore.integration.errors import (
    CorruptEngine,
    EngineCacheError,
    EngineMismatch,
    EngineUnavailable,
    RemoteEngineMiss,
)
from adstore.integration.placement.dirs import private_path
from adstore.integration.placement.place import copy_code
from adstore.integration.placement.rule import Writer, trusted_uids
from adstore.integration.validity.envcheck import find_mismatch, store_candidates
from adstore.integration.validity.keys import CacheKey, canonical, code_fingerprint, json_digest
from adstore.integration.validity.toolchain import index_settings, toolchain_identity
from adstore.store import REMOTE_REASONS, AdstoreError, Reason, is_digest

__all__ = ["INDEX_VERSION", "EngineIndex", "IndexEntry", "StageEntries", "component_digests", "index_key", "lease_key"]

logger = logging.getLogger(__name__)

#: Bumped when the index key recipe or the entry's layout changes: old entries then miss.
INDEX_VERSION = 1

#: Hash components whose digests an index entry keeps (what the cold run's engine was built for).
DIGESTED = ("version", "graph", "inputs", "settings", "toolchain")


def component_digests(components: Mapping[str, Any]) -> dict[str, str]:
    """Digest of each hash component of an engine record (``meta["components"]``)."""
    return {name: json_digest(components.get(name)) for name in DIGESTED}


def index_key(
    *,
    prefix: str,
    suffix: Sequence[Mapping[str, Any]],
    code: Sequence[type | Callable[..., Any]],
    inputs: Mapping[str, Any],
    settings: Mapping[str, Any] | None,
    backend: str,
    rank: int,
    world_size: int,
    lowered: Mapping[str, Any] | None = None,
) -> CacheKey:
    """The index key of one compile stage (module docstring); cheap, no Inductor, no export.

    ``prefix``: the cache point's key; ``suffix``: name and configuration of
    every transform from the point to the compile stage (itself included);
    ``code``: their classes or functions (source fingerprint); ``inputs``:
    :func:`~adstore.integration.engine.hashing.input_specs` of the example
    inputs; ``settings``: Inductor options; ``lowered``: op name -> code
    fingerprint of each decomposition applied before compiling (a component
    only when there are some).  Every rank has its own entry.
    """
    components = canonical(
        {
            "version": [INDEX_VERSION, HASH_VERSION],
            "backend": backend,
            "prefix": prefix,
            "suffix": list(suffix),
            "code": code_fingerprint(code),
            "inputs": inputs,
            "settings": index_settings(settings),
            "toolchain": toolchain_identity(),
            "rank": {"rank": rank, "world_size": world_size},
            **({"lowered": dict(lowered)} if lowered else {}),
        }
    )
    return CacheKey(key=json_digest(components), components=components)


def lease_key(key: CacheKey) -> str:
    """The single-flight lease of a stage whose index key is ``key``: what it makes, the same on every rank.

    Hosts that start the same cold stage take one lease, so one compiles;
    hosts compiling other options or input shapes under the same cache point
    have other leases and never wait for a record that will not come.  The
    rank's own parts (its snapshot digest, its rank) are left out, since the
    ranks of one host lead or follow together (rank 0 takes the lease).
    """
    parts = dict(key.components)
    prefix = parts.get("prefix")
    parts["prefix"] = prefix.get("key") if isinstance(prefix, Mapping) else prefix
    rank = parts.get("rank")
    parts["rank"] = {"world_size": rank.get("world_size")} if isinstance(rank, Mapping) else rank
    return json_digest({"stage_lease": parts})


@dataclass(frozen=True)
class IndexEntry:
    """What an index entry says: the engine's hash and the digests of what it was built for."""

    engine: str
    digests: dict[str, str]
    compile_seconds: float = 0.0
    #: Bytes the remote tier downloaded for this read (None: it came from the local store).
    transferred: int | None = None

    def to_json(self) -> bytes:
        body = {
            "format": INDEX_VERSION,
            "engine": self.engine,
            "digests": self.digests,
            "compile_seconds": self.compile_seconds,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> IndexEntry:
        """Parse an entry; CorruptEngine for anything but this format's exact fields."""
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptEngine(f"engine index entry is not JSON: {exc}") from exc
        if not isinstance(body, dict) or body.get("format") != INDEX_VERSION:
            found = body.get("format") if isinstance(body, dict) else None
            raise EngineMismatch(
                "index_format", f"index entry has format {found!r}, this adstore reads {INDEX_VERSION}"
            )
        engine, digests = body.get("engine"), body.get("digests")
        if not is_digest(engine):
            raise CorruptEngine(f"engine index entry names no engine hash: {str(engine)[:80]!r}")
        if not (isinstance(digests, dict) and set(digests) == set(DIGESTED) and all(map(is_digest, digests.values()))):
            raise CorruptEngine("engine index entry has no component digests")
        seconds = body.get("compile_seconds")
        return cls(
            engine=engine,
            digests=dict(digests),
            compile_seconds=float(seconds) if isinstance(seconds, (int, float)) else 0.0,
        )


class StageEntries:
    """Entries of one namespace that hold one artifact under a compile stage's key.

    The engine index (a small JSON record naming an engine) and the
    ``torch_compile`` stage's Inductor files are both kept this way, with
    the store's LRU, budget and remote tier.
    """

    def __init__(self, store: Any, namespace: str, artifact: str) -> None:
        self.store = store
        self.namespace = namespace
        self.artifact = artifact

    def manifest(self, key: CacheKey) -> Any:
        """The committed manifest under ``key``; None when there is none; an EngineCacheError when unusable.

        With a remote tier on the store, a local absence asks the remote (a
        signed record from a trusted key only; anything else is that reason).
        """
        store = self.store
        res = store.lookup(key.key, count=False, trusted=trusted_uids())  # rows checked against the record
        if not res.hit:
            if res.reason == Reason.ABSENT:
                return None
            if store.tier is not None and res.reason in REMOTE_REASONS:
                raise RemoteEngineMiss(key.key, res.reason)
            raise EngineUnavailable(key.key, f"{self.namespace} entry: {res.reason}")
        manifest = res.manifest
        if manifest is None or manifest.namespace != self.namespace or not self.accepts(manifest.artifacts):
            raise EngineUnavailable(key.key, f"not a {self.namespace} entry")
        return manifest

    def accepts(self, artifacts: Mapping[str, Any]) -> bool:
        """Whether a manifest with these artifacts is an entry of this kind (it holds :attr:`artifact`)."""
        return self.artifact in artifacts

    def read(
        self, key: CacheKey, manifest: Any, *, judge: Callable[[str, Writer], None] | None = None
    ) -> tuple[bytes, int | None]:
        """The verified artifact of ``manifest`` and what the remote tier sent for ``key`` (None: nothing).

        ``judge(key, writer)``: the artifact becomes code; it is read through a
        private copy, and ``judge`` sees who wrote the blob file that copy was
        read from and raises to refuse it (:mod:`~adstore.integration.placement`).
        """
        try:
            if judge is None:
                raw = self.store.read_artifact(manifest, self.artifact)
            else:
                dest = private_path(".code")
                try:
                    judge(key.key, copy_code(self.store, manifest.artifacts[self.artifact], dest))
                    raw = dest.read_bytes()
                finally:
                    dest.unlink(missing_ok=True)
        except EngineCacheError:
            raise
        except AdstoreError as exc:
            raise CorruptEngine(f"{self.namespace} entry {key.key[:12]} unreadable: {exc}") from exc
        return raw, self.store.tier.take_restored(key.key) if self.store.tier is not None else None

    def why_absent(self, key: CacheKey) -> tuple[Reason, str]:
        """``incompatible_env`` naming the field when this request was stored in another environment."""
        try:
            found = find_mismatch(
                store_candidates(self.store, self.namespace, exclude=key.key), key.components, env=("toolchain",)
            )
        except Exception as exc:  # noqa: BLE001 - a diagnosis never fails the lookup
            logger.debug("no environment diagnosis for %s: %s", key.key[:12], exc)
            return Reason.ABSENT, ""
        return (Reason.ABSENT, "") if found is None else (Reason.INCOMPATIBLE_ENV, found.message())

    def keyed_by(self, prefix_key: str) -> list[tuple[str, dict[str, Any]]]:
        """``(key, components)`` of this namespace's entries made under the cache point key ``prefix_key``."""
        out: list[tuple[str, dict[str, Any]]] = []
        for listed in self.store.entries(namespace=self.namespace):
            entry = self.store.entry(listed.key)
            components = dict(entry.components or {}) if entry is not None else {}
            prefix = components.get("prefix")
            if isinstance(prefix, Mapping) and prefix.get("key") == prefix_key:
                out.append((listed.key, components))
        return out

    def save(self, key: CacheKey, data: bytes, meta: Mapping[str, Any], files: Mapping[str, Any] | None = None) -> None:
        """Store ``data`` under ``key`` (a new generation replaces what was there; pushed by a remote tier).

        ``files``: further artifacts of the entry (name -> blob ref the store holds already).
        """
        self.store.save(
            key.key,
            {**(files or {}), self.artifact: self.store.put_bytes(data)},
            namespace=self.namespace,
            components=key.components,
            meta={**meta, "created": time.time()},
            trusted=trusted_uids(),
        )


class EngineIndex(StageEntries):
    """Index entries in a store: :meth:`lookup` before a compile stage, :meth:`point` after a compile."""

    NAMESPACE = "engine_index"
    ARTIFACT = "index.json"

    def __init__(self, store: Any) -> None:
        super().__init__(store, self.NAMESPACE, self.ARTIFACT)

    def lookup(self, key: CacheKey) -> IndexEntry | None:
        """The entry under ``key``; None when there is none; an EngineCacheError with a reason when unusable."""
        manifest = self.manifest(key)
        if manifest is None:
            return None
        raw, transferred = self.read(key, manifest)
        entry = IndexEntry.from_json(raw)
        return IndexEntry(entry.engine, entry.digests, entry.compile_seconds, transferred)

    def entries_for(self, prefix_key: str) -> list[tuple[str, str | None]]:
        """``(index key, engine hash or None)`` of every entry indexed under the cache point key ``prefix_key``."""
        out: list[tuple[str, str | None]] = []
        for key, components in self.keyed_by(prefix_key):
            try:
                found = self.lookup(CacheKey(key, components))
            except AdstoreError:
                found = None
            out.append((key, found.engine if found is not None else None))
        return out

    def point(self, key: CacheKey, engine: str, components: Mapping[str, Any], compile_seconds: float) -> None:
        """Point ``key`` at ``engine`` (whose record stores ``components``); replaces what was there."""
        entry = IndexEntry(engine=engine, digests=component_digests(components), compile_seconds=compile_seconds)
        self.save(key, entry.to_json(), {"engine": engine})
