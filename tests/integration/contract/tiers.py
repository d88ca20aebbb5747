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


class VllmTrees:
    """vLLM's compile directories as tree entries (:mod:`adstore.integration.vllm`), with vLLM's stand-in.

    The stand-in (:mod:`vllm_standin`, written by the suite beside this
    file as ``vllm-standin/vllm``) compiles as vLLM's AOT path does: into
    ``<VLLM_CACHE_ROOT>/torch_compile_cache/torch_aot_compile/<vLLM's hash>/``,
    where the hash is of the model's source files and config (the knobs and
    the dtype), never of the call.  The plugin's hooks are installed on the
    suite's store (what ``register()`` does for trees; Inductor's own caches
    are the ``enable`` tier's).  Each call starts with an empty
    ``torch_compile_cache``, as a new host does (the ``enable`` tier resets
    Dynamo likewise), so a call is ``served`` only when the hooks restored
    the tree from the store and the stand-in loaded it without compiling;
    its answer is the restored program's.
    """

    name = "vllm_trees"

    def setup(self, store: Any, builds: list[str]) -> None:
        import os
        import sys

        from adstore.integration.vllm import hooks

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm-standin"))
        # A login home has its XDG cache directory (0700, as the tools that make it do); what lies above
        # vLLM's cache root is the user's, judged as found (a 0775 ~/.cache of a shared group is refused).
        os.makedirs(os.path.join(os.path.expanduser("~"), ".cache"), mode=0o700, exist_ok=True)
        import vllm.envs

        self.envs = vllm.envs
        if store is not None:
            hooks.install(store)
        else:
            hooks.install()  # no store opens: vLLM as without adstore (one log line)

    def call(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], knobs: dict[str, Any]) -> Served:
        import os
        import shutil

        from vllm.compilation import decorators

        from adstore.integration.vllm import hooks

        shutil.rmtree(os.path.join(self.envs.VLLM_CACHE_ROOT, "torch_compile_cache"), ignore_errors=True)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        config = {"act": knobs.get("act", "tanh"), "k": knobs.get("k", 2.0), "dtype": dtype}
        before = len(decorators.COMPILES)
        wrapper = decorators.SupportTorchCompile(model, config)
        handle = (wrapper, model)
        out = self.again(handle, args, kwargs)
        compiles = len(decorators.COMPILES) - before
        served = bool(wrapper.was_aot_compile_fn_loaded_from_disk) and compiles == 0
        detail = "loaded the restored tree" if served else f"compiled ({hooks.status()})"
        return Served(out, served, compiles, detail, handle)

    def again(self, handle: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import inspect

        wrapper, model = handle
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        bound.apply_defaults()  # vLLM calls forward one way: every argument positional, defaults bound
        return wrapper(*bound.args)


TIERS["vllm_trees"] = VllmTrees

#: vLLM keys its compile directory by its own hash (of the model's code and config) and runs what it compiled
#: without Dynamo's guards; the plugin stores and restores the directory that hash names and never computes
#: it again (integration/vllm/hooks.py).  What the hash leaves out is served by vLLM's own directory as well.
_VLLM_HASH = (
    "vLLM's own hash's business, not adstore's: vLLM's hash (model code and config) does not hold {what}, "
    "and vLLM strips Dynamo's guards from what it compiles (its compile wrapper), so vLLM's own cache directory "
    "serves it as compiled without adstore too"
)
_NO_INDUCTOR = (
    "the stand-in runs no Inductor (its artifact is an exported program): Inductor's code in vLLM's compiles is "
    "Inductor's entries, the enable tier's (register() enables it)"
)
ROWS_NOT_KEPT.update(
    {
        ("vllm_trees", "global"): _VLLM_HASH.format(what="the value of a module global forward reads"),
        ("vllm_trees", "scalar"): _VLLM_HASH.format(what="the values of a call's non-tensor arguments")
        + " (the stand-in's exported program raises its own guard instead)",
        ("vllm_trees", "inductor_setting"): _NO_INDUCTOR,
        ("vllm_trees", "isa"): _NO_INDUCTOR,
        ("vllm_trees", "emfile"): "vLLM opens files of its own (it hashes the model's source files, writes and "
        "reads its compile directory): with no descriptor free it fails with or without the store",
    }
)
