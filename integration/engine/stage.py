"""The compile stage: the module after a cache point becomes an AOTInductor engine, found again on a restart.

Cold (no index entry): the module is exported, hashed and compiled through
the engine cache (or its engine found by hash: another checkpoint of the
same layout compiled it), stored without weights, refit with this run's
weights, and the index entry (:mod:`~adstore.integration.engine.index`)
points the stage's key at it.

Warm: the index entry names the engine; its record is checked against the
entry's digests and this toolchain, the package is opened by torch's C++
loader and the module's own tensors are refit into it.  Nothing is exported
or hashed, and neither dynamo, Inductor nor transformers is imported.

Ranks: each rank has its own entry and engine (a sharded graph with its
collective ops inside).  Every rank restores or every rank compiles; if any
rank cannot compile, every rank keeps its eager module.  Everything fails
open: a cache problem is a miss with a reason and a compile; a compile that
fails is a ``bypass`` and the eager module runs (README, "Engine cache").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from torch import nn

from adstore.integration.engine.hashing import input_specs
from adstore.integration.engine.index import EngineIndex, IndexEntry, component_digests, index_key
from adstore.integration.engine.runtime import (
    CompiledEngine,
    load_runner,
    module_weights,
    refit,
    validate_record,
    validate_runner,
)
from adstore.integration.engine.storage import StoreEngineStorage
from adstore.integration.errors import EngineCacheError, EngineMismatch, EngineUnavailable, IntegrationError
from adstore.integration.pipeline import dist as agree
from adstore.integration.pipeline.dist import Topology
from adstore.integration.pipeline.events import CacheEvent, EventKind, Source
from adstore.integration.pipeline.keys import CacheKey
from adstore.integration.pipeline.protocol import failure_reason
from adstore.integration.pipeline.remote import HeldFlight, stage_flight, wait_seconds
from adstore.store.reasons import Reason
from adstore.store.remote import Role, record_address

__all__ = ["EngineModule", "EngineStage", "graph_example_inputs"]

logger = logging.getLogger(__name__)


class EngineModule(nn.Module):
    """What the compile stage returns: the engine, called like the module it replaced.

    The weights live in the engine (a refit copies them in), so the module
    the engine was made from can be dropped.
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


def graph_example_inputs(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """Example inputs of a GraphModule, made from its placeholders' metadata (zeros of each shape and dtype).

    The graph says what it accepts, and the stage compiles for exactly that.
    Reading the metadata of a restored graph touches no fake-tensor mode.
    Raises IntegrationError for a module that is not a GraphModule or whose
    inputs have symbolic sizes (the stage then keeps the eager module).
    """
    if not isinstance(module, torch.fx.GraphModule):
        raise IntegrationError(f"the compile stage needs a GraphModule, got {type(module).__name__}")
    out: list[torch.Tensor] = []
    for node in module.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise IntegrationError(f"graph input {node.name!r} has no tensor metadata")
        if not all(isinstance(d, int) for d in val.shape):
            raise IntegrationError(f"graph input {node.name!r} has symbolic sizes {list(val.shape)}: "
                                   "the compile stage builds static engines")
        out.append(torch.zeros(tuple(int(d) for d in val.shape), dtype=val.dtype, device=val.device.type))
    return tuple(out)


@dataclass
class EngineStage:
    """One compile stage: its store, Inductor options and what keys its index entry.

    ``prefix``: the cache point's key and the digest of the snapshot restored
    or saved there (None: no index, engines are found by their hash alone);
    ``suffix``/``code``: name + configuration and the classes of every
    transform from the point through this stage; ``decompositions``: custom
    ops lowered to ATen before compiling (None: they stay in the engine).
    ``events`` collects what the stage did, in order.
    """

    root: Any = None
    remote: Any = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    prefix: Mapping[str, Any] | None = None
    suffix: Sequence[Mapping[str, Any]] = ()
    code: Sequence[type | Callable[..., Any]] = ()
    decompositions: Mapping[Any, Callable[..., Any]] | None = None
    backend: str = "aoti"
    #: The cache point's single-flight build lease when this host leads it (handed over; released here).
    flight: HeldFlight | None = None
    #: The lease key a compile stage that found nothing leads or follows under (the cache point's key).
    lease_key: str | None = None
    events: list[CacheEvent] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    _store: Any = field(default=None, repr=False)

    #: Modules whose source decides how an engine is made and found (part of the index key's ``code``).
    code_modules: ClassVar[tuple[str, ...]] = ("adstore.integration.engine.cache", "adstore.integration.engine.index",
                                               "adstore.integration.engine.runtime")

    # ----------------------------------------------------------------- public
    def store(self) -> Any:
        """The store engines and index entries live in (``root``, with the remote tier ``remote``)."""
        if self._store is None:
            from adstore.integration.pipeline.remote import remote_for
            from adstore.store import Store

            remote = None
            if self.remote or os.environ.get("ADSTORE_REMOTE", "").strip():
                opened = remote_for(self.remote)  # the process's one client per remote (one circuit breaker)
                remote = opened[0] if opened is not None else None
            self._store = Store.open(self.root, remote=remote)
        return self._store

    def key(self, example_inputs: Sequence[Any], topo: Topology) -> CacheKey | None:
        if self.prefix is None:
            return None
        code = [*self.code, EngineStage]  # this module's own source decides how the engine is made
        return index_key(prefix=dict(self.prefix), suffix=self.suffix, code=code,
                         inputs=input_specs(tuple(example_inputs)), settings=self.settings,
                         backend=self.backend + ("+lowered" if self.decompositions else ""),
                         rank=topo.rank, world_size=topo.world_size)

    def run(self, module: nn.Module, example_inputs: Sequence[Any], topo: Topology) -> nn.Module:
        """The engine for ``module`` (restored or compiled), or ``module`` itself when no engine can be had.

        A collective under an initialised process group: every rank calls it.
        """
        t0 = time.perf_counter()
        key, engine, reason, detail = self._lookup(module, example_inputs, topo)
        held = self._flight(key, engine is None and reason == Reason.ABSENT, topo)
        try:
            if held is not None and held.role is Role.FOLLOWER:  # another host compiles this key: wait for it
                engine, reason, detail = self._follow(held, module, example_inputs, key, engine, reason, detail)
            return self._finish(module, example_inputs, topo, key, engine, reason, detail, t0,
                                leading=held is not None and held.role is Role.LEADER)
        finally:
            if held is not None and held.role is Role.LEADER:
                held.finish()  # every rank's engine and index entry are pushed (or failed): followers go on

    def _finish(self, module: nn.Module, example_inputs: Sequence[Any], topo: Topology, key: CacheKey | None,
                engine: CompiledEngine | None, reason: Reason | None, detail: str, t0: float, *,
                leading: bool) -> nn.Module:
        """Agree on the restored engines, else compile (every rank), else keep the eager module (every rank)."""
        self.timings["restore"] = time.perf_counter() - t0
        # agreement 1: every rank restores its engine, or every rank compiles
        if agree.all_true(engine is not None):
            assert engine is not None
            self._event(engine.event, topo)
            return EngineModule(engine)
        if engine is not None:
            engine, reason, detail = None, Reason.PEER_MISS, "another rank found no engine"
        if key is not None or reason != Reason.KEY_ERROR:  # without an index the engine cache's own event says it
            self._event(CacheEvent(EventKind.MISS, reason=reason, key=key.key if key else None, detail=detail,
                                   seconds=time.perf_counter() - t0), topo)
        t1 = time.perf_counter()
        failure: tuple[Reason, str] | None = None
        try:
            if leading and self.flight is not None:
                self.flight.renew()  # the prefix's build may have used much of the lease
            engine = self._compile(module, example_inputs, key)
        except Exception as exc:  # noqa: BLE001 - the eager module still runs
            logger.warning("compile stage: no engine (%s: %s); the eager module runs", type(exc).__name__, exc)
            failure = (failure_reason(exc), f"{type(exc).__name__}: {exc}")
        self.timings["compile"] = time.perf_counter() - t1
        # agreement 2: every rank has an engine, or every rank keeps its eager module
        if not agree.all_true(engine is not None):
            why = failure or (Reason.RANK_DISAGREEMENT, "another rank could not compile its engine")
            self._event(CacheEvent(EventKind.BYPASS, reason=why[0], key=key.key if key else None, detail=why[1],
                                   seconds=time.perf_counter() - t1), topo)
            return module
        assert engine is not None
        self._event(engine.event, topo)
        return EngineModule(engine)

    def _lookup(self, module: nn.Module, example_inputs: Sequence[Any],
                topo: Topology) -> tuple[CacheKey | None, CompiledEngine | None, Reason | None, str]:
        try:
            key = self.key(example_inputs, topo)
            if key is None:
                return None, None, Reason.KEY_ERROR, "no cache point key: engines are found by their hash"
            return key, *self._restore(module, key, example_inputs)
        except Exception as exc:  # noqa: BLE001 - a cache problem is a miss, never a failed stage
            return None, None, failure_reason(exc), f"{type(exc).__name__}: {exc}"

    # ----------------------------------------------------------------- single flight
    def _flight(self, key: CacheKey | None, absent: bool, topo: Topology) -> HeldFlight | None:
        """The prefix's build lease: handed over by the cache point, or taken here when nothing was found.

        Collectives only when a remote is named (the same on every rank);
        see :func:`~adstore.integration.pipeline.remote.stage_flight`.
        """
        if self.flight is not None:
            return self.flight  # this host led the prefix's build: it compiles too
        if not (self.remote or os.environ.get("ADSTORE_REMOTE", "").strip()):
            return None
        tier = None
        try:
            tier = self.store().tier
        except Exception as exc:  # noqa: BLE001 - no store: no lease (the restore already missed)
            logger.debug("no store for the single-flight lease: %s", exc)
        lease = self.lease_key if key is not None else None
        return stage_flight(lease, tier.remote if tier is not None else None, absent=absent, rank=topo.rank)

    def _follow(self, held: HeldFlight, module: nn.Module, example_inputs: Sequence[Any], key: CacheKey | None,
                engine: CompiledEngine | None, reason: Reason | None,
                detail: str) -> tuple[CompiledEngine | None, Reason | None, str]:
        """Wait (bounded) until the leading host's index entry for this rank is on the remote, then restore."""
        if engine is not None or key is None or held.flight is None:
            return engine, reason, detail
        remote = held.flights.remote
        waited = held.flights.wait(held.flight, timeout=wait_seconds(), ready=lambda: remote.head(
            "ac", record_address(key.key, 0)).value is not None)
        if not waited.ready:
            logger.info("single-flight wait for engine %s ended (%s): compiling here", key.key[:12], waited.reason)
            return None, Reason(waited.reason) if waited.reason in Reason._value2member_map_ else Reason.ABSENT, \
                f"waited {waited.seconds:.1f}s for the leading host's engine"
        return self._restore(module, key, example_inputs)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # ----------------------------------------------------------------- warm
    def _restore(self, module: nn.Module, key: CacheKey,
                 example_inputs: Sequence[Any]) -> tuple[CompiledEngine | None, Reason | None, str]:
        t0 = time.perf_counter()
        index = EngineIndex(self.store())
        try:
            entry = index.lookup(key)
        except EngineCacheError as exc:
            return None, exc.reason, str(exc)
        if entry is None:
            return None, *index.why_absent(key)
        backend = StoreEngineStorage(self.store())
        try:
            record = backend.load_record(entry.engine)
        except EngineCacheError as exc:
            return None, exc.reason, f"index names engine {entry.engine[:12]}: {exc}"
        if record is None:
            return None, Reason.ENGINE_UNAVAILABLE, (f"index names engine {entry.engine[:12]}, which the store "
                                                     "no longer holds (evicted)")
        timings = {"fetch": time.perf_counter() - t0}
        try:
            meta = record.meta
            validate_record(meta, entry.engine)
            stored = component_digests(meta.get("components") or {})
            differ = sorted(k for k in stored if stored[k] != entry.digests.get(k))
            if differ:
                raise EngineMismatch(differ[0], f"engine {entry.engine[:12]} was built for other {', '.join(differ)} "
                                                "than the index entry names")
            _check_inputs(meta, example_inputs)
            backend.check_loadable(record)  # native code: only from trusted writers
            path = record.payload_path
            if path is None:  # a back end that returned bytes: the loader needs a file
                path = self.store().temp_path(".pt2")
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
        transferred = (entry.transferred or 0) + (record.transferred or 0)
        saved = max(0.0, entry.compile_seconds - seconds)
        backend.record_event(EventKind.HIT, seconds_saved=saved)
        event = CacheEvent(EventKind.HIT, key=key.key, source=Source.REMOTE if remote else Source.LOCAL,
                           seconds=seconds, seconds_saved=saved, transferred=transferred,
                           detail=f"engine {entry.engine[:12]}")
        engine = CompiledEngine(runner, hash=entry.engine, meta=meta, event=event, code_constants={},
                                timings=timings)
        return engine, None, ""

    # ----------------------------------------------------------------- cold
    def _compile(self, module: nn.Module, example_inputs: Sequence[Any], key: CacheKey | None) -> CompiledEngine:
        from adstore.integration.engine.cache import EngineCache

        store = self.store()
        model: Any = module
        if self.decompositions:
            model = torch.export.export(module, tuple(example_inputs)).run_decompositions(dict(self.decompositions))
        cache = EngineCache(StoreEngineStorage(store), memory_entries=0)
        try:
            engine = cache.compile(model, tuple(example_inputs), **dict(self.settings))
        finally:
            cache.close()
        if engine.hash is None or key is None:  # not cacheable (unhashable, unrefittable), or no index to write
            return engine
        try:
            seconds = float(engine.meta.get("compile_seconds") or 0.0)
            EngineIndex(store).save(key, engine.hash, engine.meta.get("components") or {}, seconds)
            saved = True
        except Exception as exc:  # noqa: BLE001 - the next restart compiles (or finds the engine by hash)
            logger.warning("could not index engine %s: %s", engine.hash[:12], exc)
            saved = False
        kind = EventKind.SAVE if saved else EventKind.BYPASS
        engine.event = CacheEvent(kind, reason=None if saved else Reason.SAVE_FAILED, key=key.key if key else None,
                                  source=Source.COMPILED, seconds=engine.timings.get("total", 0.0),
                                  saved=saved, detail=f"engine {engine.hash[:12]} ({engine.event.kind}"
                                                      f"{' ' + str(engine.event.reason) if engine.event.reason else ''})")
        return engine

    def _event(self, event: CacheEvent, topo: Topology) -> None:
        event = dataclasses.replace(event, rank=topo.rank, world_size=topo.world_size)
        self.events.append(event)
        logger.info("compile stage %s%s (rank %d/%d, %.3fs)%s", event.kind, f" [{event.reason}]" if event.reason else "",
                    topo.rank, topo.world_size, event.seconds, f": {event.detail}" if event.detail else "")


def _check_inputs(meta: Mapping[str, Any], example_inputs: Sequence[Any]) -> None:
    """EngineMismatch unless the engine was compiled for these input shapes and dtypes."""
    stored = [(list(i.get("shape") or []), i.get("dtype")) for i in meta.get("inputs") or ()]
    leaves = pytree.tree_leaves(tuple(example_inputs))
    wanted = [([str(d) for d in t.shape], str(t.dtype)) for t in leaves if isinstance(t, torch.Tensor)]
    if stored != wanted:
        raise EngineMismatch("inputs", f"engine was compiled for inputs {stored}, the stage has {wanted}")

