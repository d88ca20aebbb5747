"""The compile stage's ``torch_compile`` backend: a standalone artifact and its kernels travel with the stage's entry.

``torch.compile`` traces the module with Dynamo again in every process
before any cache can answer.  The stage holds the FX graph already, so it
compiles that graph with ``standalone_compile(..., aot=True)``
(:mod:`~adstore.integration.engine.standalone`) in a fresh, private Inductor
cache directory and stores, under the stage's key (namespace ``inductor``,
with the store's LRU, budget and remote tier): the serialized artifact
(``standalone.bin``) and each shared object Inductor built (``cache.<xx>.<file>``,
named as the Inductor integration names them, so a kernel is one blob
wherever it is used).  A restart places the shared objects into a fresh
private directory and loads the artifact: no tracing and no kernel build.

A graph ``standalone_compile`` cannot serve goes through ``torch.compile``
and every file Inductor wrote is stored as one blob
(:mod:`~adstore.integration.engine.bundle`, ``inductor.bundle``); a restart
unpacks it and compiles there, every Inductor cache lookup a hit.

All of it is code (shared objects, pickles): loaded only from a private
copy of a blob a trusted user wrote (the engine cache's rule, judged on the
descriptor the bytes are read from, :mod:`~adstore.integration.placement`),
and from a remote only out of a signed record by a trusted key.  A damaged,
missing or untrusted blob is a miss with its reason and a compile that
replaces it (docs/engine-cache.md, "torch_compile: a standalone artifact travels with the entry").
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adstore.integration.coordination.events import CacheEvent, EventKind, Source
from adstore.integration.engine import bundle, standalone
from adstore.integration.engine.index import StageEntries
from adstore.integration.engine.storage import StoreEngineStorage
from adstore.integration.errors import EngineCacheError, InductorCacheError, UntrustedEngine, failure_reason
from adstore.integration.inductor.entries import InductorEntries
from adstore.integration.inductor.kernels import headers_deferred
from adstore.integration.placement import probes as isa
from adstore.integration.placement.dirs import private_dir, private_path
from adstore.integration.placement.place import copy_code
from adstore.integration.placement.rule import blob_refusal, trusted_uids
from adstore.integration.validity import roots
from adstore.integration.validity.keys import CacheKey
from adstore.store import AdstoreError, Reason

__all__ = ["ARTIFACT", "NAMESPACE", "STANDALONE", "compile", "restore"]

logger = logging.getLogger(__name__)

NAMESPACE = "inductor"
ARTIFACT = "inductor.bundle"
#: The serialized ``standalone_compile`` artifact; the entry's other artifacts are its shared objects.
STANDALONE = "standalone.bin"


def restore(
    stage: Any, module: nn.Module, key: CacheKey, example_inputs: Sequence[Any]
) -> tuple[tuple[nn.Module, CacheEvent] | None, Reason | None, str]:
    """``module`` compiled from what is stored under ``key`` (artifact, else Inductor's files); else None and why."""
    t0 = time.perf_counter()
    store = stage.store()
    entries = _entries(store)
    try:
        manifest = entries.manifest(key)
    except AdstoreError as exc:
        return None, Reason(failure_reason(exc, Reason.ENGINE_ERROR)), str(exc)
    if manifest is None:
        return None, *entries.why_absent(key)
    if stale := _named_after_paths(manifest):
        return None, Reason.ENGINE_MISMATCH, stale
    if STANDALONE in manifest.artifacts:
        return _restore_standalone(store, module, key, manifest, example_inputs, t0)
    try:
        blob, transferred = entries.read(key, manifest, judge=StoreEngineStorage(store).check_writer)  # code
    except AdstoreError as exc:
        return None, Reason(failure_reason(exc, Reason.ENGINE_ERROR)), str(exc)
    fetched = time.perf_counter() - t0
    workdir = Path(tempfile.mkdtemp(prefix="adstore-inductor-", dir=private_dir()))  # code: no other user may rename
    try:
        try:
            files = bundle.unpack(blob, workdir)
        except EngineCacheError as exc:
            return None, exc.reason, str(exc)
        shared = set(workdir.rglob("*.so"))
        compiled, stats = _compile_in(workdir, module, example_inputs)
        built = len(set(workdir.rglob("*.so")) - shared)  # what the stored files lacked: compiled here
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    event = _hit(
        key,
        t0,
        transferred,
        len(blob),
        f"{files} Inductor files ({fetched:.3f}s to fetch), {built} shared objects built; {stats}",
    )
    return (compiled, event), None, ""


def compile(
    stage: Any, module: nn.Module, example_inputs: Sequence[Any], key: CacheKey | None
) -> tuple[nn.Module, CacheEvent]:
    """Compile ``module`` (``standalone_compile``, else ``torch.compile``) and store the result under ``key``."""
    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="adstore-inductor-", dir=private_dir()))  # code: no other user may rename
    try:
        try:
            compiled, data, files, stats, meta = _standalone_in(workdir, module, example_inputs)
            artifact = STANDALONE
        except Exception as exc:  # noqa: BLE001 - a graph standalone_compile cannot serve: Dynamo's path
            logger.info("standalone_compile could not serve the stage (%s: %s); torch.compile", type(exc).__name__, exc)
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(mode=0o700)
            compiled, stats = _compile_in(workdir, module, example_inputs, probe=True)
            data, files, artifact, meta = bundle.pack(workdir), [], ARTIFACT, _naming()
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
            stats = f"standalone_compile failed ({why}), Inductor's files stored; {stats}"
        seconds = time.perf_counter() - t0
        if key is None:
            return compiled, CacheEvent(
                EventKind.BYPASS,
                reason=Reason.KEY_ERROR,
                source=Source.COMPILED,
                seconds=seconds,
                detail=f"compiled, nothing stored (no cache point key); {stats}",
            )
        try:
            store = stage.store()
            refs = InductorEntries(store, trusted=trusted_uids(), owns_store=False).file_refs(files, workdir, None)
            StageEntries(store, NAMESPACE, artifact).save(key, data, {"compile_seconds": seconds, **meta}, refs)
        except Exception as exc:  # noqa: BLE001 - the next restart compiles again, nothing else
            logger.warning("could not store the compiled stage %s: %s", key.key[:12], exc)
            return compiled, CacheEvent(
                EventKind.BYPASS,
                reason=Reason.SAVE_FAILED,
                key=key.key,
                source=Source.COMPILED,
                seconds=seconds,
                detail=f"{type(exc).__name__}: {exc}",
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return compiled, CacheEvent(
        EventKind.SAVE, key=key.key, source=Source.COMPILED, seconds=seconds, saved=True, bytes=len(data), detail=stats
    )


def _compile_in(
    workdir: Path, module: nn.Module, example_inputs: Sequence[Any], *, probe: bool = False
) -> tuple[nn.Module, str]:
    """``torch.compile(module)``, compiled now by one call under ``no_grad`` with ``workdir`` as Inductor's cache.

    ``probe``: probe the CPU's vector ISA again first (the compile whose files are stored).
    """
    t0 = time.perf_counter()
    import torch._inductor.compile_fx  # noqa: F401 - timed apart: what every process pays before tracing
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    if probe:
        try:
            isa.forget()
        except Exception as exc:  # noqa: BLE001 - at worst a restart from these files probes again
            logger.debug("Inductor's ISA probe not reset: %s", exc)

    t1 = time.perf_counter()
    before = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
    compiled = torch.compile(module, dynamic=False)
    # Kernels compile in this process: a worker pool started earlier in the process (by an earlier
    # compile) keeps the cache directory it started with, so its kernels would miss ``workdir``.
    with (
        temporary_cache_dir(str(workdir)),
        torch._inductor.config.patch(compile_threads=1),
        torch.no_grad(),
        roots.relocated(),
        headers_deferred(),  # a restore whose kernels are all placed builds no header (~150 MB)
    ):
        compiled(*example_inputs)
    seen = {
        name: counters[group].get(name, 0) - before.get(group, {}).get(name, 0)
        for group, names in (
            ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss")),
            ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss")),
        )
        for name in names
    }
    stats = ", ".join(f"{k} {v}" for k, v in seen.items())
    timing = f"imports {t1 - t0:.2f}s, trace + compile or load {time.perf_counter() - t1:.2f}s"
    return compiled, f"{stats}; {timing}"  # type: ignore[return-value]


def _standalone_in(
    workdir: Path, module: nn.Module, example_inputs: Sequence[Any]
) -> tuple[nn.Module, bytes, list[str], str, dict[str, Any]]:
    """``standalone_compile`` of ``module``'s graph with ``workdir`` as Inductor's cache directory.

    Returns the module to run, the serialized artifact, the shared objects
    Inductor built in ``workdir`` (the kernels and the ISA probes: a load
    without them compiles them again), what it did, and the entry's meta
    (the ISA probes' answers, ``isa_probes``).
    """
    t0 = time.perf_counter()
    import torch._inductor.compile_fx  # noqa: F401 - timed apart: what every compiling process pays
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    if not isinstance(module, torch.fx.GraphModule):
        raise EngineCacheError(f"standalone_compile needs a GraphModule, got {type(module).__name__}")
    try:
        isa.forget()
    except Exception as exc:  # noqa: BLE001 - at worst a restart from these files probes again
        logger.debug("Inductor's ISA probe not reset: %s", exc)
    t1 = time.perf_counter()
    flat = standalone.flat_graph(module)
    with (
        temporary_cache_dir(str(workdir)),
        torch._inductor.config.patch(compile_threads=1),
        isa.PROBES.scope({}) as probes,
        roots.relocated(),
    ):
        artifact, data = standalone.compile_graph(flat, module, example_inputs)
    files = sorted(str(p) for p in workdir.glob("*/*.so") if p.is_file() and not p.is_symlink())
    stats = (
        f"standalone_compile, {len(flat.weights)} weights as inputs, {len(files)} shared objects stored; "
        f"imports {t1 - t0:.2f}s, compile {time.perf_counter() - t1:.2f}s"
    )
    compiled = standalone.StandaloneModule(module, flat, artifact, example_inputs)
    return compiled, data, files, stats, {"isa_probes": probes, **_naming()}


def _restore_standalone(
    store: Any, module: nn.Module, key: CacheKey, manifest: Any, example_inputs: Sequence[Any], t0: float
) -> tuple[tuple[nn.Module, CacheEvent] | None, Reason | None, str]:
    """Load the stored artifact: its kernels placed into a fresh private Inductor directory first; no tracing."""
    if not isinstance(module, torch.fx.GraphModule):
        return None, Reason.INTEGRATION_ERROR, f"a standalone artifact needs a GraphModule, got {type(module).__name__}"
    transferred = store.tier.take_restored(key.key) if store.tier is not None else None
    trusted = trusted_uids()
    workdir = Path(tempfile.mkdtemp(prefix="adstore-inductor-", dir=private_dir()))  # code: no other user may rename
    path = private_path(".pt2c")
    try:
        try:
            placed = InductorEntries(store, trusted=trusted, owns_store=False).materialize(
                manifest.artifacts, workdir, None
            )
            why = blob_refusal(store, copy_code(store, manifest.artifacts[STANDALONE], path), trusted)
            if why is not None:
                raise UntrustedEngine(key.key, None, f"artifact refused: {why}")
        except (EngineCacheError, InductorCacheError) as exc:
            return None, Reason(failure_reason(exc, Reason.ENGINE_ERROR)), str(exc)
        except AdstoreError as exc:  # the store quarantined a damaged blob: the compile replaces the entry
            return None, Reason.CORRUPT_ENGINE, f"{NAMESPACE} entry {key.key[:12]} unreadable: {exc}"
        t1 = time.perf_counter()
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        known = isa.valid_answers(manifest.meta.get("isa_probes"))
        try:
            with (
                temporary_cache_dir(str(workdir)),
                torch._inductor.config.patch(compile_threads=1),
                isa.PROBES.scope(known) as probes,
                roots.relocated(),
                headers_deferred(),
            ):
                artifact = standalone.load(path)
        except Exception as exc:  # noqa: BLE001 - an artifact torch rejects (another build) is a miss
            return None, Reason.LOAD_FAILED, f"{type(exc).__name__}: {exc}"
        loaded = time.perf_counter() - t1
        answered = sum(1 for name in probes if name in known)
        built = sum(1 for p in workdir.glob("*/*.so")) - placed  # what the stored files lacked: compiled here
    finally:
        path.unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    compiled = standalone.StandaloneModule(module, standalone.flat_graph(module), artifact, example_inputs)
    size = manifest.artifacts[STANDALONE].size
    event = _hit(
        key,
        t0,
        transferred,
        size,
        (
            f"standalone artifact, {placed} shared objects placed, {built} shared objects built, "
            f"{answered} of {len(probes)} ISA probes answered by the entry; load {loaded:.2f}s"
        ),
    )
    return (compiled, event), None, ""


def _naming() -> dict[str, str]:
    """The entry's meta naming how its kernels are named: relative to the install roots where this torch allows."""
    return {"kernel_names": roots.RELOCATION} if roots.supported() else {}


def _named_after_paths(manifest: Any) -> str:
    """Why an entry is not served here: its kernels are named after the builder's install paths ("" when fine).

    A load would name them relative to this host's roots, miss every one and
    build it, on every restart; compiling once replaces the entry.
    """
    meta = manifest.meta if isinstance(manifest.meta, dict) else {}
    if meta.get("kernel_names") == roots.RELOCATION or not _naming():
        return ""
    return "its kernels are named after the builder's install paths (saved before relative names): compiled again"


def _hit(key: CacheKey, t0: float, transferred: int | None, nbytes: int, detail: str) -> CacheEvent:
    """The event of a restore from the stage's entry (``transferred``: what a remote sent, None for local)."""
    return CacheEvent(
        EventKind.HIT,
        key=key.key,
        source=Source.REMOTE if transferred is not None else Source.LOCAL,
        seconds=time.perf_counter() - t0,
        transferred=transferred or 0,
        bytes=nbytes,
        detail=detail,
    )


class _Entries(StageEntries):
    """The stage's entries: a standalone artifact with its kernels, or (a graph it cannot serve) a bundle."""

    def accepts(self, artifacts: Any) -> bool:
        return STANDALONE in artifacts or ARTIFACT in artifacts


def _entries(store: Any) -> StageEntries:
    return _Entries(store, NAMESPACE, ARTIFACT)
