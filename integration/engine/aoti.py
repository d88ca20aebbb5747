"""The compile stage's ``aoti`` backend: an AOTInductor engine, compiled once and found again from the stage's key.

Cold (no index entry): the module is exported, hashed and compiled through
the engine cache (or its engine found by hash: another checkpoint of the
same layout compiled it), stored without weights, refit with this run's
weights, and the index entry (:mod:`~adstore.integration.engine.index`)
points the stage's key at it.

Warm: the index entry names the engine; its record is checked against the
entry's digests, this toolchain and the stage's input shapes, the package is
opened by torch's C++ loader and the module's own tensors are refit into it.
Nothing is exported or hashed, and neither dynamo, Inductor nor
transformers is imported (docs/engine-cache.md, "What a warm restart does").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from adstore.integration.coordination.events import CacheEvent, EventKind, Source
from adstore.integration.engine.calls import CallBinding
from adstore.integration.engine.index import EngineIndex, component_digests
from adstore.integration.engine.runtime import (
    CompiledEngine,
    load_runner,
    module_weights,
    refit,
    runner_in_spec,
    validate_record,
    validate_runner,
)
from adstore.integration.engine.storage import StoreEngineStorage
from adstore.integration.errors import EngineCacheError, EngineMismatch
from adstore.integration.placement.dirs import private_path
from adstore.integration.validity.keys import CacheKey
from adstore.store import Reason

__all__ = ["EngineModule", "compile", "restore"]

logger = logging.getLogger(__name__)


class EngineModule(nn.Module):
    """What the ``aoti`` compile stage returns: the engine, called like the module it replaced.

    A call is bound as that module binds it (keyword arguments by name) and
    runs only with the inputs the engine was compiled for; any other (a
    size, a dtype, another scalar) raises
    :class:`~adstore.integration.errors.InputMismatch` instead of a wrong
    answer.  The weights live in the engine (a refit copies them in), so the
    module the engine was made from can be dropped.
    """

    def __init__(self, engine: CompiledEngine) -> None:
        super().__init__()
        self.engine = engine

    @property
    def event(self) -> CacheEvent:
        return self.engine.event

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"hash={self.engine.hash and self.engine.hash[:12]}, source={self.engine.source}"


def restore(
    stage: Any, module: nn.Module, key: CacheKey, example_inputs: Sequence[Any]
) -> tuple[tuple[nn.Module, CacheEvent] | None, Reason | None, str]:
    """The indexed engine for ``key``, loaded and refit with ``module``'s tensors; else None and why not."""
    t0 = time.perf_counter()
    index = EngineIndex(stage.store())
    try:
        entry = index.lookup(key)
    except EngineCacheError as exc:
        return None, exc.reason, str(exc)
    if entry is None:
        return None, *index.why_absent(key)
    backend = StoreEngineStorage(stage.store())
    try:
        record = backend.load_record(entry.engine)
    except EngineCacheError as exc:
        return None, exc.reason, f"index names engine {entry.engine[:12]}: {exc}"
    if record is None:
        return (
            None,
            Reason.ENGINE_UNAVAILABLE,
            (f"index names engine {entry.engine[:12]}, which the store no longer holds (evicted)"),
        )
    timings = {"fetch": time.perf_counter() - t0}
    try:
        meta = record.meta
        validate_record(meta, entry.engine)
        stored = component_digests(meta.get("components") or {})
        differ = sorted(k for k in stored if stored[k] != entry.digests.get(k))
        if differ:
            raise EngineMismatch(
                differ[0],
                f"engine {entry.engine[:12]} was built for other {', '.join(differ)} than the index entry names",
            )
        check_inputs(meta, example_inputs)
        backend.check_loadable(record)  # native code: only from trusted writers (of the file the copy came from)
        path = record.payload_path  # in this process's private directory: what was checked is what loads
        if path is None:  # a back end that returned bytes: the loader needs a file
            path = private_path(".pt2")
            path.write_bytes(record.payload_bytes())
            record.payload_path, record.owns_path = path, True
        t1 = time.perf_counter()
        runner = load_runner(path)
        timings["load"] = time.perf_counter() - t1
        validate_runner(runner, meta)
        spec = meta["constants"]
        timings["refit"] = refit(runner, module_weights(module, spec), spec)
    except EngineCacheError as exc:
        return None, exc.reason, str(exc)
    except Exception as exc:  # noqa: BLE001 - a package the loader rejects is a miss
        return None, Reason.LOAD_FAILED, f"{type(exc).__name__}: {exc}"
    finally:
        record.release()
    seconds = time.perf_counter() - t0
    remote = entry.transferred is not None or record.transferred is not None
    saved = max(0.0, entry.compile_seconds - seconds)
    backend.record_event(EventKind.HIT, seconds_saved=saved)
    event = CacheEvent(
        EventKind.HIT,
        key=key.key,
        source=Source.REMOTE if remote else Source.LOCAL,
        seconds=seconds,
        seconds_saved=saved,
        transferred=(entry.transferred or 0) + (record.transferred or 0),
        detail=f"engine {entry.engine[:12]}",
    )
    binding = CallBinding.of_model(module, runner_in_spec(runner))  # how ``module`` is called
    engine = CompiledEngine(
        runner,
        hash=entry.engine,
        meta=meta,
        event=event,
        code_constants={},
        timings=timings,
        binding=binding,
        example_inputs=example_inputs,
    )
    return (EngineModule(engine), event), None, ""


def compile(
    stage: Any, module: nn.Module, example_inputs: Sequence[Any], key: CacheKey | None
) -> tuple[nn.Module, CacheEvent]:
    """Compile ``module`` through the engine cache (``stage.settings``, ``stage.decompositions``); index it."""
    from adstore.integration.engine.cache import EngineCache

    store = stage.store()
    model: Any = module
    if stage.decompositions:
        model = torch.export.export(module, tuple(example_inputs)).run_decompositions(dict(stage.decompositions))
    cache = EngineCache(StoreEngineStorage(store), memory_entries=0)
    try:
        engine = cache.compile(model, tuple(example_inputs), **dict(stage.settings))
    finally:
        cache.close()
    if engine.hash is None or key is None:  # not cacheable (unhashable, unrefittable), or no index to write
        return EngineModule(engine), engine.event
    try:
        seconds = float(engine.meta.get("compile_seconds") or 0.0)
        EngineIndex(store).point(key, engine.hash, engine.meta.get("components") or {}, seconds)
        saved = True
    except Exception as exc:  # noqa: BLE001 - the next restart compiles (or finds the engine by hash)
        logger.warning("could not index engine %s: %s", engine.hash[:12], exc)
        saved = False
    how = f"{engine.event.kind}{' ' + str(engine.event.reason) if engine.event.reason else ''}"
    engine.event = CacheEvent(
        EventKind.SAVE if saved else EventKind.BYPASS,
        reason=None if saved else Reason.SAVE_FAILED,
        key=key.key,
        source=Source.COMPILED,
        seconds=engine.timings.get("total", 0.0),
        saved=saved,
        detail=f"engine {engine.hash[:12]} ({how})",
    )
    return EngineModule(engine), engine.event


def check_inputs(meta: Mapping[str, Any], example_inputs: Sequence[Any]) -> None:
    """EngineMismatch unless the engine was compiled for these input shapes and dtypes."""
    stored = [(list(i.get("shape") or []), i.get("dtype")) for i in meta.get("inputs") or ()]
    leaves = pytree.tree_leaves(tuple(example_inputs))
    wanted = [([str(d) for d in t.shape], str(t.dtype)) for t in leaves if isinstance(t, torch.Tensor)]
    if stored != wanted:
        raise EngineMismatch("inputs", f"engine was compiled for inputs {stored}, the stage has {wanted}")
