"""The tiers of the contract suite, one small adapter each, run inside a child process.

An adapter serves one call of the model the way its tier does and says
whether the answer came from the store.  Everything else (the processes,
their environments and hash seeds, the rows, the comparison with eager of
the module as it is now) is the suite's, the same for every tier.  A new
tier joins by writing an adapter and listing it in :data:`TIERS`.

``served`` means the answer was loaded from an entry (the rows that must
hit want it; the rows that must not serve a stale answer accept it only
when the output equals eager).  ``compiles`` counts what the tier would
have run without the store: C++ kernel builds for the compiling tiers, the
``build()`` of the pipeline cache.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["Served", "Tier", "TIERS", "ROWS_NOT_KEPT"]


@dataclass
class Served:
    output: Any
    served: bool
    compiles: int
    detail: str = ""
    handle: Any = None  # what a later call of the same object reuses (``reuse`` calls)


class Tier(Protocol):
    name: str

    def setup(self, store: Any, builds: list[str]) -> None: ...

    def call(
        self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], knobs: dict[str, Any]
    ) -> Served: ...

    def again(self, handle: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


def _kernel_builds(builds: list[str]) -> int:
    return len([b for b in builds if not b.endswith(".i")])  # g++ -E of the header runs in every process


class AotCompile:
    """``adstore.integration.inductor.aot_compile``: torch's AOT artifact of ``forward``."""

    name = "aot_compile"

    def setup(self, store: Any, builds: list[str]) -> None:
        self.store, self.builds = store, builds

    def call(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], knobs: dict[str, Any]) -> Served:
        from adstore.integration.inductor import aot_compile

        before = _kernel_builds(self.builds)
        compiled = aot_compile(model, args, kwargs, store=self.store)
        out = compiled(*args, **kwargs)
        return Served(
            out,
            compiled.outcome == "hit",
            _kernel_builds(self.builds) - before,
            f"{compiled.outcome} {compiled.reason or ''}".strip(),
            compiled,
        )

    def again(self, handle: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return handle(*args, **kwargs)


class Enable:
    """``adstore.integration.inductor.enable()``: Inductor's own caches and kernels in the store."""

    name = "enable"

    def setup(self, store: Any, builds: list[str]) -> None:
        from adstore.integration import inductor

        self.builds = builds
        inductor.enable(store)

    def call(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], knobs: dict[str, Any]) -> Served:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()  # each call is a first call, as in a new process (and no recompile limit)
        hits = counters["inductor"]["fxgraph_cache_hit"]
        misses = counters["inductor"]["fxgraph_cache_miss"]
        before = _kernel_builds(self.builds)
        fn = torch.compile(model)
        out = fn(*args, **kwargs)
        compiles = _kernel_builds(self.builds) - before
        hit = counters["inductor"]["fxgraph_cache_hit"] - hits
        miss = counters["inductor"]["fxgraph_cache_miss"] - misses
        return Served(out, hit > 0 and miss == 0 and compiles == 0, compiles, f"fx hits {hit} misses {miss}", fn)

    def again(self, handle: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return handle(*args, **kwargs)


class CachedPrefix:
    """``adstore.integration.cached_prefix``: an exported module's snapshot, weights loaded after.

    The caller names the key: this adapter names what a user would (the
    constructor's arguments, the example inputs' specs, the model's classes
    as ``code``).  A global ``forward`` reads is not a constructor argument;
    that row is not this tier's (:data:`ROWS_NOT_KEPT`).
    """

    name = "cached_prefix"

    def setup(self, store: Any, builds: list[str]) -> None:
        pass

    def call(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], knobs: dict[str, Any]) -> Served:
        import contract_model

        from adstore.integration import cached_prefix

        builds = []

        def build() -> nn.Module:
            builds.append(1)
            meta = copy.deepcopy(model).to("meta")
            margs = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
            return torch.export.export(meta, margs, dict(kwargs)).module()

        spec = [(list(a.shape), list(a.stride()), str(a.dtype)) if isinstance(a, torch.Tensor) else a for a in args]
        key = {"model": {"act": knobs.get("act", "tanh"), "k": knobs.get("k", 2.0)}, "inputs": spec, "kw": kwargs}
        res = cached_prefix(key, build, code=[contract_model.Model, contract_model.Block])  # the store ADSTORE_* name
        self.prefix = res  # what a stage after this cache point keys on
        restored = res.module
        restored.load_state_dict(model.state_dict(), assign=True)
        out = restored(*args, **kwargs)
        return Served(out, res.hit, len(builds), str(res.event.kind), restored)

    def again(self, handle: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return handle(*args, **kwargs)


TIERS: dict[str, Callable[[], Tier]] = {"aot_compile": AotCompile, "enable": Enable, "cached_prefix": CachedPrefix}

#: Rows a tier does not keep, and why (the suite's table shows the reason instead of a pass).
ROWS_NOT_KEPT: dict[tuple[str, str], str] = {
    ("cached_prefix", "global"): "the caller names the key: a global is not a component",
    ("cached_prefix", "grad_mode"): "an exported graph does not depend on grad mode",
    ("cached_prefix", "inductor_setting"): "no Inductor code in a snapshot",
    ("cached_prefix", "isa"): "no Inductor code in a snapshot",
}


def _positional(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The call's inputs as the positional example tuple ``torch.export`` takes (keywords bound by name)."""
    import inspect

    return tuple(inspect.signature(model.forward).bind(*args, **kwargs).args)


def _hit(events: Any) -> bool:
    """Whether a cache's events say the answer was restored (the first event a ``hit``)."""
    from adstore.integration.coordination.events import EventKind

    return bool(events) and events[0].kind == EventKind.HIT


class EngineCacheTier:
    """``adstore.integration.engine.compile``: an AOTInductor engine found by its architecture hash, refit.

    The hash is of the exported graph, so what ``forward`` computes (a
    global's value, a closure cell, an attribute) is in it as the export
    saw it.  The engine returned is that graph compiled: like any exported
    program it does not re-trace when a global changes after it was made
    (:data:`ROWS_NOT_KEPT`, ``global_in_place``).
    """

    name = "engine"

    def setup(self, store: Any, builds: list[str]) -> None:
        self.store, self.builds = store, builds

    def call(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], knobs: dict[str, Any]) -> Served:
        from adstore.integration.engine import compile as engine_compile
        from adstore.integration.engine.storage import StoreEngineStorage

        backend = StoreEngineStorage(store=self.store) if self.store is not None else None
        before = _kernel_builds(self.builds)
        engine = engine_compile(model, _positional(model, args, kwargs), engine_cache=backend)
        out = engine(*args, **kwargs)
        event = engine.event
        compiles = _kernel_builds(self.builds) - before
        return Served(out, _hit([event]), compiles, f"{event.kind.value} {event.reason or ''}".strip(), engine)

    def again(self, handle: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return handle(*args, **kwargs)


class CompileStage(CachedPrefix):
    """The compile stage after a cache point (:class:`~adstore.integration.engine.stage.EngineStage`).

    The prefix is :class:`CachedPrefix`'s (same key, same snapshot); the
    stage's entry is found from that key and the snapshot's digest, so the
    rows the prefix does not keep are not the stage's either.  ``backend``:
    ``aoti`` (an AOTInductor engine, refit) or ``torch_compile``
    (``standalone_compile`` of the graph, its kernels stored beside it).
    """

    name = "stage_aoti"
    backend = "aoti"

    def setup(self, store: Any, builds: list[str]) -> None:
        self.builds = builds

    def call(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], knobs: dict[str, Any]) -> Served:
        from adstore.integration.coordination.dist import topology
        from adstore.integration.engine.stage import EngineStage

        before = _kernel_builds(self.builds)
        module = super().call(model, args, kwargs, knobs).handle
        res = self.prefix
        stage = EngineStage(
            prefix={"key": res.key, "snapshot": res.snapshot} if res.key and res.snapshot else None,
            suffix=[{"name": "compile", "config": {}}],
            backend=self.backend,
        )
        try:
            compiled = stage.run(module, _positional(model, args, kwargs), topology())
        finally:
            stage.close()
        out = compiled(*args, **kwargs)
        compiles = _kernel_builds(self.builds) - before
        detail = " ".join(f"{e.kind.value}:{e.reason or ''}" for e in stage.events)
        return Served(out, _hit(stage.events), compiles, detail, compiled)


class CompileStageInductor(CompileStage):
    """The compile stage's ``torch_compile`` backend (see :class:`CompileStage`)."""

    name = "stage_torch_compile"
    backend = "torch_compile"


TIERS.update({"engine": EngineCacheTier, "stage_aoti": CompileStage, "stage_torch_compile": CompileStageInductor})

#: The compiled tiers run what torch compiled for inference: an engine's output never requires grad.
_INFERENCE_ONLY = "a compiled engine serves inference: its output never requires grad (values equal eager's)"
#: The compile stage follows its cache point's key: the rows the caller's key does not name are not its either.
_PREFIX_ROWS = {
    "global": "the cache point's caller names the key: a global is not a component",
    "grad_mode": _INFERENCE_ONLY,
}
ROWS_NOT_KEPT.update(
    {
        ("engine", "grad_mode"): _INFERENCE_ONLY,
        ("engine", "global_in_place"): "an exported program does not re-trace: the engine computes a global as "
        "exported, with or without the store (torch.export's contract)",
        **{(stage, row): why for stage in ("stage_aoti", "stage_torch_compile") for row, why in _PREFIX_ROWS.items()},
        **{
            (tier, "emfile"): "torch's compiler opens files of its own (its cache directory, the C++ compiler): "
            "with no descriptor free it fails with or without the store"
            for tier in ("aot_compile", "enable", "engine", "stage_aoti", "stage_torch_compile")
        },
        ("cached_prefix", "remote"): "no remote tier: cached_prefix has a root (and its seed) only; "
        "the pipeline_cache transform has the remote",
    }
)
