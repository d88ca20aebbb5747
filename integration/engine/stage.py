"""The compile stage after a cache point: compile once, find the result again from the pipeline's key.

A stage that runs after the cache point knows its graph without looking at
it (:mod:`~adstore.integration.engine.index`): its key is the cache point's
key, the digest of the snapshot restored or saved there, the configuration
and source of every transform since, the example inputs, the Inductor
settings, the toolchain and the rank.  The backend decides what is cached
under it: ``aoti`` an AOTInductor engine (:mod:`~adstore.integration.engine.aoti`),
``torch_compile`` what Inductor wrote while compiling
(:mod:`~adstore.integration.engine.inductor`).

This module is the protocol both share.  Ranks: each rank has its own entry
(a sharded graph, with its collective ops inside); every rank restores or
every rank compiles, and if any rank cannot compile, every rank keeps its
eager module.  Fleets: when several hosts start one cold stage, a
single-flight lease on the stage's own key
(:func:`~adstore.integration.engine.index.lease_key`) makes one host compile
and the others restore what it pushed; a host compiling another stage under
the same cache point never waits for it.  Everything fails open: a cache
problem is a miss with a reason and a compile; a compile that fails is a
``bypass`` and the eager module runs (docs/engine-cache.md, "The compile stage").
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
from torch import nn

from adstore.integration.coordination import dist as agree
from adstore.integration.coordination.dist import Topology
from adstore.integration.coordination.events import CacheEvent, EventKind
from adstore.integration.coordination.remote import HeldFlight, stage_flight, wait_seconds
from adstore.integration.engine.hashing import input_specs
from adstore.integration.engine.index import index_key, lease_key
from adstore.integration.errors import ConfigError, IntegrationError, failure_reason
from adstore.integration.validity.keys import CacheKey, code_fingerprint
from adstore.store import Reason
from adstore.store.remote import Role, record_address

__all__ = ["Built", "EngineStage", "graph_example_inputs"]

logger = logging.getLogger(__name__)

#: What a backend restores or compiles: the module to run and the event that says how it was had.
Built = tuple[nn.Module, CacheEvent]


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
            raise IntegrationError(
                f"graph input {node.name!r} has symbolic sizes {list(val.shape)}: "
                "the compile stage builds static engines"
            )
        out.append(torch.zeros(tuple(int(d) for d in val.shape), dtype=val.dtype, device=val.device.type))
    return tuple(out)


@dataclass
class EngineStage:
    """One compile stage: its backend, store, Inductor options and what keys its entry.

    ``backend``: ``aoti`` or ``torch_compile``; ``prefix``: the cache point's
    key and the digest of the snapshot restored or saved there (None: no
    key; ``aoti`` engines are then found by their hash alone);
    ``suffix``/``code``: name + configuration and the classes of every
    transform from the point through this stage; ``decompositions``: custom
    ops lowered to ATen before compiling (None: they stay in the engine).
    ``events`` collects what the stage did, in order.  With a remote, a
    stage that finds nothing leads or follows a lease on its own key.
    """

    root: Any = None
    remote: Any = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    prefix: Mapping[str, Any] | None = None
    suffix: Sequence[Mapping[str, Any]] = ()
    code: Sequence[type | Callable[..., Any]] = ()
    decompositions: Mapping[Any, Callable[..., Any]] | None = None
    backend: str = "aoti"
    events: list[CacheEvent] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    _store: Any = field(default=None, repr=False)

    #: Modules whose source decides how what is cached is made and found (part of the key's ``code``).
    code_modules: ClassVar[tuple[str, ...]] = (
        "adstore.integration.engine.bundle",
        "adstore.integration.engine.cache",
        "adstore.integration.engine.index",
        "adstore.integration.engine.runtime",
        "adstore.integration.engine.standalone",
        "adstore.integration.inductor.entries",
    )

    # ----------------------------------------------------------------- public
    def store(self) -> Any:
        """The store engines and index entries live in (``root``, with the remote tier ``remote``).

        Without a ``root``, the store the environment names, its seed
        (``ADSTORE_SEED``) and budget included, as the cache point before the
        stage opens it: a new host whose prefix a seed serves finds the
        stage's entry there too, instead of compiling.
        """
        if self._store is None:
            from adstore.integration.coordination.remote import remote_for
            from adstore.store import Store

            remote = None
            if self.remote or os.environ.get("ADSTORE_REMOTE", "").strip():
                opened = remote_for(self.remote)  # the process's one client per remote (one circuit breaker)
                remote = opened[0] if opened is not None else None
            if self.root is None:
                self._store = Store.from_env(remote=remote)
            else:
                self._store = Store.open(self.root, remote=remote)
        return self._store

    def key(self, example_inputs: Sequence[Any], topo: Topology) -> CacheKey | None:
        if self.prefix is None:
            return None
        code = [*self.code, EngineStage, _builder(self.backend).restore]  # how it is made and found
        # Each lowering by its code (source, closure, defaults), not its op's name: an edited one recompiles.
        lowered = {str(op): code_fingerprint([fn]) for op, fn in (self.decompositions or {}).items()}
        return index_key(
            prefix=dict(self.prefix),
            suffix=self.suffix,
            code=code,
            inputs=input_specs(tuple(example_inputs)),
            settings=self.settings,
            backend=self.backend,
            rank=topo.rank,
            world_size=topo.world_size,
            lowered=lowered,
        )

    def run(self, module: nn.Module, example_inputs: Sequence[Any], topo: Topology) -> nn.Module:
        """The compiled module (restored or compiled), or ``module`` itself when none can be had.

        A collective under an initialised process group: every rank calls it.
        """
        t0 = time.perf_counter()
        key, built, reason, detail = self._lookup(module, example_inputs, topo)
        held = self._flight(key, built is None and reason == Reason.ABSENT, topo)
        try:
            if held is not None and held.role is Role.FOLLOWER:  # another host compiles this key: wait for it
                built, reason, detail = self._follow(held, module, example_inputs, key, built, reason, detail)
            return self._finish(module, example_inputs, topo, key, built, reason, detail, t0)
        finally:
            if held is not None and held.role is Role.LEADER:
                held.finish()  # every rank's result is pushed (or failed): followers go on

    def _finish(
        self,
        module: nn.Module,
        example_inputs: Sequence[Any],
        topo: Topology,
        key: CacheKey | None,
        built: Built | None,
        reason: Reason | None,
        detail: str,
        t0: float,
    ) -> nn.Module:
        """Agree on the restored modules, else compile (every rank), else keep the eager module (every rank)."""
        self.timings["restore"] = time.perf_counter() - t0
        # agreement 1: every rank restores, or every rank compiles
        if agree.all_true(built is not None):
            assert built is not None
            self._event(built[1], topo)
            return built[0]
        if built is not None:
            built, reason, detail = None, Reason.PEER_MISS, "another rank found nothing to restore"
        if key is not None or reason != Reason.KEY_ERROR:  # without an index the engine cache's own event says it
            self._event(
                CacheEvent(
                    EventKind.MISS,
                    reason=reason,
                    key=key.key if key else None,
                    detail=detail,
                    seconds=time.perf_counter() - t0,
                ),
                topo,
            )
        t1 = time.perf_counter()
        failure: tuple[Reason, str] | None = None
        try:
            built = self._compile(module, example_inputs, key)
        except Exception as exc:  # noqa: BLE001 - the eager module still runs
            logger.warning("compile stage: nothing compiled (%s: %s); the eager module runs", type(exc).__name__, exc)
            failure = (Reason(failure_reason(exc, Reason.ERROR)), f"{type(exc).__name__}: {exc}")
        self.timings["compile"] = time.perf_counter() - t1
        # agreement 2: every rank compiled, or every rank keeps its eager module
        if not agree.all_true(built is not None):
            why = failure or (Reason.RANK_DISAGREEMENT, "another rank could not compile")
            self._event(
                CacheEvent(
                    EventKind.BYPASS,
                    reason=why[0],
                    key=key.key if key else None,
                    detail=why[1],
                    seconds=time.perf_counter() - t1,
                ),
                topo,
            )
            return module
        assert built is not None
        self._event(built[1], topo)
        return built[0]

    def _lookup(
        self, module: nn.Module, example_inputs: Sequence[Any], topo: Topology
    ) -> tuple[CacheKey | None, Built | None, Reason | None, str]:
        try:
            key = self.key(example_inputs, topo)
            if key is None:
                return None, None, Reason.KEY_ERROR, "no cache point key: engines are found by their hash"
            return key, *self._restore(module, key, example_inputs)
        except Exception as exc:  # noqa: BLE001 - a cache problem is a miss, never a failed stage
            return None, None, Reason(failure_reason(exc, Reason.ERROR)), f"{type(exc).__name__}: {exc}"

    # ----------------------------------------------------------------- single flight
    def _flight(self, key: CacheKey | None, absent: bool, topo: Topology) -> HeldFlight | None:
        """The lease on this stage's own key, taken when nothing was found (lead: compile; follow: wait).

        Not the cache point's: stages under one point that compile other
        options or input shapes must not wait on each other.  Collectives only
        when a remote is named (the same on every rank); see
        :func:`~adstore.integration.coordination.remote.stage_flight`.
        """
        if not (self.remote or os.environ.get("ADSTORE_REMOTE", "").strip()):
            return None
        tier = None
        try:
            tier = self.store().tier
        except Exception as exc:  # noqa: BLE001 - no store: no lease (the restore already missed)
            logger.debug("no store for the single-flight lease: %s", exc)
        lease = lease_key(key) if key is not None else None
        return stage_flight(lease, tier.remote if tier is not None else None, absent=absent, rank=topo.rank)

    def _follow(
        self,
        held: HeldFlight,
        module: nn.Module,
        example_inputs: Sequence[Any],
        key: CacheKey | None,
        built: Built | None,
        reason: Reason | None,
        detail: str,
    ) -> tuple[Built | None, Reason | None, str]:
        """Wait (bounded) until the leading host's entry for this rank's key is on the remote, then restore."""
        if built is not None or key is None or held.flight is None:
            return built, reason, detail
        remote = held.flights.remote
        waited = held.flights.wait(
            held.flight,
            timeout=wait_seconds(),
            ready=lambda: remote.head("ac", record_address(key.key, 0)).value is not None,
        )
        if not waited.ready:
            logger.info("single-flight wait for engine %s ended (%s): compiling here", key.key[:12], waited.reason)
            return (
                None,
                Reason(waited.reason) if waited.reason in Reason._value2member_map_ else Reason.ABSENT,
                f"waited {waited.seconds:.1f}s for the leading host's engine",
            )
        return self._restore(module, key, example_inputs)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # ----------------------------------------------------------------- the backend's half
    def _restore(
        self, module: nn.Module, key: CacheKey, example_inputs: Sequence[Any]
    ) -> tuple[Built | None, Reason | None, str]:
        """The backend's restore: the module it makes from what the store holds under ``key`` (and its
        ``hit`` event), else None and why not."""
        return _builder(self.backend).restore(self, module, key, example_inputs)

    def _compile(self, module: nn.Module, example_inputs: Sequence[Any], key: CacheKey | None) -> Built:
        """The backend's compile: the module and its event; what it made is saved under ``key`` if given."""
        return _builder(self.backend).compile(self, module, example_inputs, key)

    def _event(self, event: CacheEvent, topo: Topology) -> None:
        event = dataclasses.replace(event, rank=topo.rank, world_size=topo.world_size)
        self.events.append(event)
        logger.info(
            "compile stage %s%s (rank %d/%d, %.3fs)%s",
            event.kind,
            f" [{event.reason}]" if event.reason else "",
            topo.rank,
            topo.world_size,
            event.seconds,
            f": {event.detail}" if event.detail else "",
        )


def _builder(backend: str) -> Any:
    """The module that restores and compiles for ``backend`` (``restore``/``compile`` functions)."""
    if backend == "aoti":
        from adstore.integration.engine import aoti

        return aoti
    if backend == "torch_compile":
        from adstore.integration.engine import inductor

        return inductor
    raise ConfigError("backend", f"the compile stage has no backend {backend!r} (aoti, torch_compile)")
