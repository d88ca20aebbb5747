"""The compile stage's ``torch_compile`` backend: what Inductor wrote travels with the stage's entry.

``torch.compile`` cannot be stored as one engine: Dynamo traces the module
again in every process and guards what it traced.  What makes a second
process fast is Inductor's on-disk caches (the compiled kernels, the
FX-graph and AOTAutograd cache entries), which a new host does not have.
So the stage compiles in a fresh, private Inductor cache directory, running
the module once on the graph's example inputs (under ``no_grad``, as
inference calls it), and stores every file Inductor wrote there as one blob
(:mod:`~adstore.integration.engine.bundle`) under the stage's key
(namespace ``inductor``, with the store's LRU, budget and remote tier).  A
restart unpacks that blob into a fresh directory and compiles there: Dynamo
traces, and every Inductor cache lookup hits.

The files are code (shared objects, Python modules, pickles): they are only
unpacked from a blob file a trusted user wrote (the engine cache's rule,
judged on the descriptor the bytes are read from, :mod:`~adstore.integration.engine.codefiles`),
and from a remote only out of a signed record by a trusted key.  A damaged,
missing or untrusted blob is a miss with its reason and a compile that
replaces it (docs/engine-cache.md, "torch_compile: what Inductor produced travels with the entry").
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from adstore.integration.engine import bundle
from adstore.integration.engine.codefiles import private_dir
from adstore.integration.engine.index import StageEntries
from adstore.integration.engine.storage import StoreEngineStorage
from adstore.integration.errors import EngineCacheError
from adstore.integration.pipeline.events import CacheEvent, EventKind, Source
from adstore.integration.pipeline.keys import CacheKey
from adstore.store import AdstoreError, Reason

__all__ = ["ARTIFACT", "NAMESPACE", "compile", "restore"]

logger = logging.getLogger(__name__)

NAMESPACE = "inductor"
ARTIFACT = "inductor.bundle"


def restore(
    stage: Any, module: nn.Module, key: CacheKey, example_inputs: Sequence[Any]
) -> tuple[tuple[nn.Module, CacheEvent] | None, Reason | None, str]:
    """``module`` compiled with the Inductor files stored under ``key``; else None and why not."""
    t0 = time.perf_counter()
    store = stage.store()
    try:
        blob, transferred = _read(store, key)
    except AdstoreError as exc:
        return None, Reason(exc.reason) if exc.reason in Reason._value2member_map_ else Reason.ENGINE_ERROR, str(exc)
    if blob is None:
        return None, *_entries(store).why_absent(key)
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
    event = CacheEvent(
        EventKind.HIT,
        key=key.key,
        source=Source.REMOTE if transferred is not None else Source.LOCAL,
        seconds=time.perf_counter() - t0,
        transferred=transferred or 0,
        bytes=len(blob),
        detail=f"{files} Inductor files ({fetched:.3f}s to fetch), {built} shared objects built; {stats}",
    )
    return (compiled, event), None, ""


def compile(
    stage: Any, module: nn.Module, example_inputs: Sequence[Any], key: CacheKey | None
) -> tuple[nn.Module, CacheEvent]:
    """Compile ``module`` in a fresh Inductor cache directory, then store what Inductor wrote under ``key``."""
    t0 = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="adstore-inductor-", dir=private_dir()))  # code: no other user may rename
    try:
        compiled, stats = _compile_in(workdir, module, example_inputs, probe=True)
        blob = bundle.pack(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
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
        _entries(stage.store()).save(key, blob, {"compile_seconds": seconds})
    except Exception as exc:  # noqa: BLE001 - the next restart compiles again, nothing else
        logger.warning("could not store the Inductor files of %s: %s", key.key[:12], exc)
        return compiled, CacheEvent(
            EventKind.BYPASS,
            reason=Reason.SAVE_FAILED,
            key=key.key,
            source=Source.COMPILED,
            seconds=seconds,
            detail=f"{type(exc).__name__}: {exc}",
        )
    return compiled, CacheEvent(
        EventKind.SAVE, key=key.key, source=Source.COMPILED, seconds=seconds, saved=True, bytes=len(blob), detail=stats
    )


def _forget_isa_probe() -> None:
    """Make Inductor probe the CPU's vector ISA again, so the probe's programs land in the new cache directory.

    Inductor picks the ISA by compiling and loading small test programs in
    its cache directory, once per process (functools caches).  A process
    that probed before the stage would leave them out of the stored files,
    and every restart from those files would compile them again (seconds).
    Another torch without these caches: nothing to clear.
    """
    from torch._inductor import cpu_vec_isa

    for obj in list(vars(cpu_vec_isa).values()):
        for fn in [obj, *(vars(obj).values() if isinstance(obj, type) else ())]:
            clear = getattr(fn, "cache_clear", None)
            if callable(clear):
                clear()
    # What an earlier probe learnt about extensions (bf16, AMX) changes the flags of the next one,
    # and with them the programs' names: back to the state of a fresh process.
    for isa in getattr(cpu_vec_isa, "supported_vec_isa_list", ()):
        for name in [n for n in vars(isa) if n.startswith("_is_")]:
            delattr(isa, name)


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
            _forget_isa_probe()
        except Exception as exc:  # noqa: BLE001 - at worst a restart from these files probes again
            logger.debug("Inductor's ISA probe not reset: %s", exc)

    t1 = time.perf_counter()
    before = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
    compiled = torch.compile(module, dynamic=False)
    # Kernels compile in this process: a worker pool started earlier in the process (by an earlier
    # compile) keeps the cache directory it started with, so its kernels would miss ``workdir``.
    with temporary_cache_dir(str(workdir)), torch._inductor.config.patch(compile_threads=1), torch.no_grad():
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


def _entries(store: Any) -> StageEntries:
    return StageEntries(store, NAMESPACE, ARTIFACT)


def _read(store: Any, key: CacheKey) -> tuple[bytes | None, int | None]:
    """The verified bundle stored under ``key`` (None when there is none) and what the remote sent for it."""
    entries = _entries(store)
    manifest = entries.manifest(key)
    if manifest is None:
        return None, None
    return entries.read(key, manifest, judge=StoreEngineStorage(store).check_writer)  # code: trusted writers only
