"""Inductor's cache entries as store entries: keys, values, kernel files, and failing open.

One store entry per Inductor cache entry, in a namespace per cache
(``inductor_fx_graph``, ``inductor_aot_autograd``, ...).  Its key is the
SHA-256 of Inductor's own key (as the remote cache hands it to a backend)
together with torch's build key (``torch_key``) and adstore's toolchain
fingerprint (the engine cache's :func:`toolchain_identity`), and for an
FX-graph entry how its kernels are named (``kernel_names``: relative to the
install roots, :mod:`adstore.integration.validity.roots`); those are the entry's components, so
``adstore explain`` shows them.  Artifacts:

* ``value``: the bytes Inductor gave the backend (JSON holding a base64 pickle
  for FX-graph and AOTAutograd entries), returned as they were;
* ``cache.<xx>.<file>``: a kernel file under Inductor's cache directory
  (``<cache dir>/<xx>/<file>``), named by Inductor after its source's hash;
* ``pch.<file>``: a precompiled header file (toolchain entry only), whose
  meta also records the answers to Inductor's ISA probes (``isa_probes``,
  :mod:`~adstore.integration.placement.probes`).  The answers also travel
  alone, in a small entry of the same namespace (Inductor key ``isa``): every
  start needs them, but only a start that builds a kernel needs the ~150 MB
  header, so a new host fetches the header from a remote only then.

Kernel files are captured and placed under the rule for files that become
code (:mod:`~adstore.integration.placement`): a file in a directory another
user could write in, or that a trusted user does not own, is never stored.

The store does the rest: deduplication (a kernel two graphs share is one
blob), compression, LRU and budget, the remote tier with signed records,
``adstore ls/stats/explain/rm``.  Nothing here caches or evicts on its own.

Everything fails open: a problem is logged once per reason, counted as
``inductor.failopen.<reason>`` (in the store when it can count, and in
:data:`FAILOPEN` always), and Inductor goes on as it would without adstore.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from adstore.integration.coordination.flights import flights_for
from adstore.integration.errors import failure_reason
from adstore.integration.inductor.hostview import note_miss
from adstore.integration.inductor.toolchain_entry import (
    choose,
    explain_paths,
    header_of,
    install_paths,
    keyed_paths,
    merge,
    path_differences,
)
from adstore.integration.placement.capture import capture_files
from adstore.integration.placement.place import place, read_trusted
from adstore.integration.placement.probes import PROBES, valid_answers
from adstore.integration.placement.rule import Writer, blob_refusal
from adstore.integration.validity import roots
from adstore.store import Reason

__all__ = [
    "InductorEntries",
    "FAILOPEN",
    "ISA_KEY",
    "NAMESPACES",
    "TOOLCHAIN_KEY",
    "TOOLCHAIN_NAMESPACE",
    "VALUE",
    "host_report",
    "note_failure",
]

logger = logging.getLogger(__name__)

#: Inductor's remote caches (by the class name torch looks them up by) and the namespace of each.
NAMESPACES = {
    "RemoteFxGraphCache": "inductor_fx_graph",
    "RemoteAOTAutogradCache": "inductor_aot_autograd",
    "RemoteAutotuneCache": "inductor_autotune",
    "RemoteBundledAutotuneCache": "inductor_bundled_autotune",
    "RemoteDynamoPGOCache": "inductor_dynamo_pgo",
}
_FX = NAMESPACES["RemoteFxGraphCache"]
#: The namespaces whose misses take a single-flight lease: each miss is followed by a compile and its put
#: (Dynamo's PGO entry is read at the start and written at the end of a whole compile: never leased).
FLIGHT_NAMESPACES = frozenset({"inductor_fx_graph"})
TOOLCHAIN_NAMESPACE = "inductor_toolchain"
#: The Inductor keys of the toolchain's two entries: headers and answers, and the answers alone.
TOOLCHAIN_KEY, ISA_KEY = "toolchain", "isa"
VALUE = "value"

#: Why adstore stood aside, this process (``inductor.failopen.<reason>`` in the store as well).
FAILOPEN: Counter[str] = Counter()
_logged: set[str] = set()
_logged_lock = threading.Lock()

_CACHE_FILE = re.compile(r"cache\.([a-z0-9]{2})\.([A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*)")
_PCH_FILE = re.compile(r"pch\.([A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*)")


def note_failure(
    reason: str, detail: str, store: Any = None, *, scope: str = "inductor", fallback: str = "Inductor compiles"
) -> None:
    """Count one fail-open under ``reason``; log it the first time this process meets the reason.

    ``scope`` names the integration (``<scope>.failopen.<reason>`` in the store; in :data:`FAILOPEN`
    the bare reason for Inductor, ``<scope>.<reason>`` for the others) and ``fallback`` what happens
    instead, so every integration that fails open counts and logs the same way.
    """
    counted = reason if scope == "inductor" else f"{scope}.{reason}"
    FAILOPEN[counted] += 1
    if store is not None:
        try:
            store.count({f"{scope}.failopen.{reason}": 1})
        except Exception:  # noqa: BLE001 - counting is best effort; the log line below still says why
            pass
    with _logged_lock:
        first = counted not in _logged
        _logged.add(counted)
    if first:
        logger.warning("adstore: %s without adstore here (%s): %s", fallback, reason, detail)


class InductorEntries:
    """Reads and writes Inductor's entries in one store; every method fails open (never raises)."""

    def __init__(self, store: Any, *, trusted: frozenset[int], owns_store: bool) -> None:
        self.store = store
        self.trusted = trusted
        self.owns_store = owns_store
        #: Hits served, by namespace, this process (``inductor.hits.<namespace>`` in the store).
        self.served: Counter[str] = Counter()
        #: Build leases on the store's remote: a fleet compiles each FX graph once.
        self.flights = flights_for(store)

    @functools.cached_property
    def identity(self) -> dict[str, Any]:
        """torch's build key and the toolchain fingerprint: part of every key."""
        from torch._inductor.codecache import torch_key

        from adstore.integration.validity.toolchain import toolchain_identity
        from adstore.integration.validity.torchkey import wait_recorded

        wait_recorded()  # a key being recorded is given to torch when done: not hashed twice

        return {"torch_key": torch_key().hex(), "toolchain": toolchain_identity()}

    def key(self, namespace: str, inductor_key: str) -> tuple[str, dict[str, Any]]:
        """The store key of an Inductor key in ``namespace``, and its components."""
        from adstore.integration.validity.keys import json_digest

        components = {"namespace": namespace, "inductor_key": inductor_key, **self.identity}
        if namespace == _FX and roots.active():
            # its kernels are named relative to the install roots: an entry of path-named kernels is another entry
            components["kernel_names"] = roots.RELOCATION
        return json_digest(components), components

    # -- Inductor's get and put -------------------------------------------------
    def get(self, namespace: str, inductor_key: str) -> bytes | None:
        """The value stored for ``inductor_key``, its kernel files placed first; None on a miss or any problem."""
        try:
            key, components = self.key(namespace, inductor_key)
            res = self.store.lookup(key, trusted=self.trusted)  # code: the rows must agree with a trusted record
            if not res.hit and res.reason == Reason.ABSENT and namespace in FLIGHT_NAMESPACES:
                if self.flights.after_miss(key, namespace):  # another host (or process) compiled it meanwhile
                    res = self.store.lookup(key, trusted=self.trusted)
                    self.find_toolchain()  # its builder saved the ISA answers before it let us go: no probe here
            if not res.hit:
                if res.reason != Reason.ABSENT:
                    note_failure(str(res.reason), f"{namespace} entry {key[:12]} not served", self.store)
                note_miss(key, components)  # for `adstore explain KEY`: the nearest entry and what differs
                return None
            manifest = res.manifest
            if manifest is None or manifest.namespace != namespace or VALUE not in manifest.artifacts:
                note_failure(str(Reason.STORE_ERROR), f"{key[:12]} is not an {namespace} entry", self.store)
                return None
            data = read_trusted(self.store, manifest.artifacts[VALUE], self.trusted)
            self.materialize(manifest.artifacts, Path(_cache_dir()), _header_dir())
            self._served(namespace, manifest.meta)
            return data
        except Exception as exc:  # noqa: BLE001 - fail open: Inductor compiles
            note_failure(failure_reason(exc), f"{namespace} get: {exc}", self.store)
            return None

    def put(
        self, namespace: str, inductor_key: str, data: bytes, files: Iterable[str] = (), seconds: float | None = None
    ) -> None:
        """Store ``data`` (and the kernel ``files``, paths under Inductor's cache directory) as one entry.

        ``seconds``: how long Inductor took from its lookup to this save (the
        compile a later hit saves; in the entry's meta as ``compile_seconds``).
        """
        try:
            key, components = self.key(namespace, inductor_key)
            artifacts = {VALUE: self.store.put_bytes(bytes(data))}
            artifacts.update(self.file_refs(files, Path(_cache_dir()), _header_dir()))
            meta: dict[str, Any] = {} if seconds is None else {"compile_seconds": round(max(0.0, seconds), 3)}
            if namespace == _FX:
                meta["paths"] = keyed_paths()  # the builder's, for `adstore explain`
                if roots.active():
                    meta["kernel_names"] = roots.RELOCATION  # named without them: a hit elsewhere finds its kernels
            self._publish(key, namespace, components, artifacts, meta)
        except Exception as exc:  # noqa: BLE001 - fail open: the compile's result is used, not kept
            note_failure(failure_reason(exc), f"{namespace} put: {exc}", self.store)

    def built(self, namespace: str, inductor_key: str) -> None:
        """After :meth:`put` (and the toolchain's save): release a lease ``inductor_key`` was compiled under."""
        try:
            self.flights.built(self.key(namespace, inductor_key)[0], namespace)
        except Exception as exc:  # noqa: BLE001 - an unreleased lease expires
            logger.debug("single-flight release: %s", exc)

    def _served(self, namespace: str, meta: Any) -> None:
        """Count a hit adstore served: per namespace, and the compile it saved (FX-graph entries only).

        An AOTAutograd hit loads its FX graphs through the FX-graph cache, so
        counting both entries' compile time would count the same compile twice.
        """
        self.served[namespace] += 1
        if isinstance(meta, dict) and isinstance(meta.get("paths"), dict) and "kernel_names" not in meta:
            # kernels named after the builder's paths (an entry of a torch adstore cannot rename them for)
            explain_paths(path_differences(meta["paths"], keyed_paths()), self.store)
        counts = {f"inductor.hits.{namespace}": 1}
        seconds = meta.get("compile_seconds") if isinstance(meta, dict) else None
        if namespace == _FX and isinstance(seconds, int | float) and seconds > 0:
            counts["ms_saved"] = int(seconds * 1000)
        self.store.count(counts)

    # -- the toolchain entry ------------------------------------------------------
    def restore_toolchain(self, answered: threading.Event | None = None) -> int:
        """Learn the ISA probes' answers and place the precompiled headers stored for this toolchain at once.

        Returns how many files were placed (:meth:`find_toolchain`, then :meth:`place_toolchain`).
        """
        return self.place_toolchain() if self.find_toolchain(answered) else 0

    def find_toolchain(self, answered: threading.Event | None = None) -> bool:
        """Learn the ISA probes' answers: from the answers' own entry, else from the whole toolchain entry.

        ``answered`` is set once the answers are known (or known to be
        absent).  The headers (~150 MB, a download from a remote) are left to
        :meth:`place_toolchain`, which Inductor's first kernel build calls: a
        start whose kernels all come from the store never needs them.
        Returns False when the store failed (counted and logged here): then
        there is no header to place either.
        """
        try:
            key, _ = self.key(TOOLCHAIN_NAMESPACE, ISA_KEY)
            res = self.store.lookup(key, trusted=self.trusted)
            if res.hit and res.manifest is not None and valid_answers(res.manifest.meta.get("isa_probes")):
                PROBES.learn(res.manifest.meta.get("isa_probes"))
                return True
            if not res.hit and res.reason != Reason.ABSENT:
                note_failure(str(res.reason), f"toolchain answers {key[:12]} not served", self.store)
            manifest = self._toolchain_manifest()  # a store saved before the answers travelled alone
            if manifest is not None:
                PROBES.learn(manifest.meta.get("isa_probes"))
            return True
        except Exception as exc:  # noqa: BLE001 - fail open: Inductor probes
            note_failure(failure_reason(exc), f"toolchain restore: {exc}", self.store)
            return False
        finally:
            if answered is not None:
                answered.set()

    def place_toolchain(self) -> int:
        """Place the precompiled headers stored for this toolchain that fit this host; how many were new."""
        try:
            manifest = self._toolchain_manifest()
            if manifest is None:
                return 0
            chosen, differs = choose(manifest.artifacts, manifest.meta, install_paths())
            # Inductor builds its own header (and, for entries named after paths, kernels): say which path made it
            explain_paths(
                differs,
                self.store,
                "its precompiled header" if roots.active() else "its precompiled header and kernels",
            )
            return self.materialize(chosen, Path(_cache_dir()), _header_dir())
        except Exception as exc:  # noqa: BLE001 - fail open: Inductor builds them
            note_failure(failure_reason(exc), f"toolchain restore: {exc}", self.store)
            return 0

    def _toolchain_manifest(self) -> Any:
        """The whole toolchain entry's manifest (restored from a remote on a local miss); None on a miss."""
        key, components = self.key(TOOLCHAIN_NAMESPACE, TOOLCHAIN_KEY)
        res = self.store.lookup(key, trusted=self.trusted)
        if not res.hit or res.manifest is None:
            if res.reason != Reason.ABSENT:
                note_failure(str(res.reason), f"toolchain entry {key[:12]} not served", self.store)
            note_miss(key, components)
            return None
        return res.manifest

    def save_toolchain(self, files: Iterable[str], answers: Mapping[str, bool], stored: set[str]) -> None:
        """Store the toolchain's files and ISA answers unless the entries hold them all (``stored``: seen).

        The answers go to their own entry; the header entry is saved only when
        this process settled a header (``files``) it does not hold.  A process
        that built no kernel therefore never touches the header entry, and a
        save merges with this store's own entry only (``local=True``): looking
        it up through the remote would download every header it holds (~150 MB
        each) just to learn that nothing needs saving.  A host that builds a
        kernel placed the entry before (:meth:`place_toolchain`), so it is here.
        """
        try:
            cache_dir, header_dir = Path(_cache_dir()), _header_dir()
            names = {_artifact_name(f, cache_dir, header_dir) for f in files} - {None}
            mine = valid_answers(answers)
            if names | set(mine) <= stored:
                return
            self._save_answers(mine)
            stored.update(mine)
            if names <= stored:
                return  # no header met: the header entry is neither looked up nor saved
            key, components = self.key(TOOLCHAIN_NAMESPACE, TOOLCHAIN_KEY)
            res = self.store.lookup(key, count=False, trusted=self.trusted, local=True)
            old = res.manifest if res.hit and res.manifest is not None else None
            known = valid_answers(old.meta.get("isa_probes")) if old is not None else {}
            if old is not None and names <= set(old.artifacts) and mine.items() <= known.items():
                stored.update(old.artifacts, known)
                return
            artifacts, meta = merge(
                self._trusted_refs(old.artifacts) if old is not None else None,
                old.meta if old is not None else None,
                self.file_refs(files, cache_dir, header_dir),
                install_paths(),
            )
            if not artifacts and not mine:
                return
            merged = {**known, **mine}
            meta["isa_probes"] = merged
            self._publish(key, TOOLCHAIN_NAMESPACE, components, artifacts, meta)
            stored.update(artifacts, merged)
        except Exception as exc:  # noqa: BLE001 - fail open
            note_failure(failure_reason(exc), f"toolchain save: {exc}", self.store)

    def _save_answers(self, mine: Mapping[str, bool]) -> None:
        """The answers' own entry, merged with what it holds (saved only when this process adds one)."""
        if not mine:
            return
        key, components = self.key(TOOLCHAIN_NAMESPACE, ISA_KEY)
        res = self.store.lookup(key, count=False, trusted=self.trusted, local=True)  # restored at start, if anywhere
        known = valid_answers(res.manifest.meta.get("isa_probes")) if res.hit and res.manifest is not None else {}
        if mine.items() <= known.items():
            return
        merged = {**known, **mine}
        value = self.store.put_bytes(json.dumps(merged, sort_keys=True).encode())
        self._publish(key, TOOLCHAIN_NAMESPACE, components, {VALUE: value}, {"isa_probes": merged})

    def _trusted_refs(self, artifacts: Any) -> dict[str, Any]:
        """The artifacts whose blobs this user would load: a merged entry never republishes what it would refuse.

        A header goes whole (its ``.h`` with its ``.gch``) when any of its files is refused.
        """
        refused: set[str] = set()
        for name, ref in artifacts.items():
            path = self.store.blob_path(ref)
            try:
                st = None if path is None else os.stat(path, follow_symlinks=False)
            except OSError:
                refused.add(name)
                continue
            if blob_refusal(self.store, Writer.of(st), self.trusted) is not None:
                refused.add(name)
        gone = {header_of(n) for n in refused} - {None}
        return {n: r for n, r in artifacts.items() if n not in refused and header_of(n) not in gone}

    # -- files ----------------------------------------------------------------------
    def materialize(self, artifacts: Any, cache_dir: Path, header_dir: Path | None) -> int:
        """Place every file artifact (trusted writer, verified copy) before Inductor looks; how many were new.

        Raises on the first file that cannot be placed: the caller treats the
        whole entry as a miss, so Inductor compiles and the save replaces it.
        """
        placed = 0
        for name, ref in artifacts.items():
            target = _target(name, cache_dir, header_dir)
            if target is None:
                continue
            directory, filename = target
            if (directory / filename).exists():  # Inductor's own file; never loaded from us
                continue
            mode = 0o755 if filename.endswith(".so") else 0o644
            # The store's read path quarantines a damaged blob: the entry misses until it is saved again.
            if place(self.store, ref, directory=directory, name=filename, trusted=self.trusted, mode=mode):
                placed += 1
        if placed:
            self.store.count({"inductor.files_placed": placed})
        return placed

    def file_refs(self, files: Iterable[str], cache_dir: Path, header_dir: Path | None) -> dict[str, Any]:
        """Each Inductor file among ``files`` as a blob, by artifact name (``cache.<xx>.<file>``, ``pch.<file>``).

        Captured under the rule for code (:func:`~adstore.integration.placement.capture.capture_files`):
        a file refused is left out, counted and logged once (``inductor.failopen.<reason>``).
        """
        named: dict[str, str] = {}
        for path in files:
            name = _artifact_name(path, cache_dir, header_dir)
            if name is not None and name not in named.values():
                named[path] = name
        captured = capture_files(self.store, named, self.trusted)
        for path, exc in captured.refused.items():
            note_failure(failure_reason(exc), f"{path} not stored: {exc}", self.store)
        return {named[path]: ref for path, ref in captured.refs.items()}

    def _publish(
        self, key: str, namespace: str, components: dict[str, Any], artifacts: dict[str, Any], meta: Any = None
    ) -> None:
        """One entry through the store's one publish path (a failed save leaves nothing)."""
        meta = {"files": len(artifacts) - (VALUE in artifacts), **(meta or {})}
        if self.store.save(key, artifacts, namespace=namespace, components=components, meta=meta, trusted=self.trusted):
            self.store.count_event("save")  # not when skipped: a blob another user owns (untrusted_dedup)


def _artifact_name(path: str, cache_dir: Path, header_dir: Path | None) -> str | None:
    """``cache.<xx>.<file>`` or ``pch.<file>`` for a file Inductor wrote; None for anything else."""
    p = Path(path)
    if header_dir is not None and p.parent == header_dir:
        name = f"pch.{p.name}"
    elif p.parent.parent == cache_dir:
        name = f"cache.{p.parent.name}.{p.name}"
    else:
        return None
    return name if _target(name, cache_dir, header_dir) is not None and len(name) <= 128 else None


def _target(name: str, cache_dir: Path, header_dir: Path | None) -> tuple[Path, str] | None:
    """Where an artifact named by :func:`_artifact_name` goes; None for other names (validated whole)."""
    if m := _CACHE_FILE.fullmatch(name):
        return cache_dir / m.group(1), m.group(2)
    if header_dir is not None and (m := _PCH_FILE.fullmatch(name)):
        return header_dir, m.group(1)
    return None


def _cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return str(cache_dir())


def _header_dir() -> Path | None:
    from torch._inductor import codecache

    found = getattr(codecache, "_HEADER_DIR", None)
    return Path(found) if isinstance(found, str) else None


def host_report() -> dict[str, Any]:
    """This host's key components (``adstore explain --host``): imports torch and Inductor's codecache."""
    from torch._inductor.codecache import torch_key

    from adstore.integration.inductor.toolchain_entry import KEYED_PATHS
    from adstore.integration.validity.toolchain import toolchain_identity

    entries = InductorEntries(None, trusted=frozenset(), owns_store=False)
    toolchain_key, _ = entries.key(TOOLCHAIN_NAMESPACE, TOOLCHAIN_KEY)
    umask = os.umask(0)
    os.umask(umask)
    return {
        "toolchain": toolchain_identity(),
        "torch_key": torch_key().hex(),
        "toolchain_entry": toolchain_key,
        "paths": install_paths(),
        "keyed_paths": list(KEYED_PATHS),
        "roots": dict(roots.host_roots()),  # kernel names hold these by name (roots.RELOCATION), not by path
        "user": {"uid": os.getuid(), "gid": os.getgid(), "umask": f"{umask:03o}"},
    }
