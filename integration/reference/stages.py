"""The stage-bound transforms of the reference pipeline: build, export, cleanup, weights, KV cache, compile.

Pattern rewrites, sharding and post-load fusion live beside these in
``patterns``, ``sharding`` and ``fusion``; ``pipeline`` lists them all in
stage order (docs/pipeline-cache.md, "The reference pipeline").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from adstore.integration.coordination.events import CacheEvent, EventKind
from adstore.integration.errors import IntegrationError
from adstore.integration.pipeline.graphs import canonicalize, graph_modules, replace_devices
from adstore.integration.pipeline.transforms import PipelineContext, Stage, Transform, TransformConfig
from adstore.store import ConfigError, Reason

__all__ = ["BACKENDS", "BuildModel", "CleanupExport", "Compile", "ExportToGraph", "InitCache", "LoadWeights"]


class BuildModel(Transform):
    """Build the architecture on the meta device from the factory's config."""

    name = "build_model"
    stage = Stage.BUILD_MODEL
    code_modules = (
        "adstore.integration.reference.models",
        "adstore.integration.reference.metabuild",
        "adstore.integration.reference.experts",
        "adstore.integration.reference.ops",
    )

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        return ctx.factory.build(device="meta")


@dataclass(kw_only=True)
class ExportConfig(TransformConfig):
    """Example shape of the trace; ``dynamic`` makes batch and sequence symbolic.

    With ``dynamic`` the module runs at any batch up to ``max_batch`` and any
    sequence length up to ``max_seq`` (slower to export); without it only at
    ``batch`` x ``seq``.
    """

    batch: int = 2
    seq: int = 8
    strict: bool = False
    dynamic: bool = False
    max_batch: int = 64
    max_seq: int = 4096

    def validate(self, owner: str) -> None:
        if self.batch < 1 or self.seq < 1:
            raise ConfigError(f"{owner}.seq", "batch and seq must be positive")
        if self.dynamic and (self.batch < 2 or self.seq < 2):
            raise ConfigError(
                f"{owner}.seq",
                "a dynamic export needs an example batch and seq >= 2 (export specialises sizes 0 and 1)",
            )
        if self.dynamic and (self.max_batch < self.batch or self.max_seq < self.seq):
            raise ConfigError(f"{owner}.max_seq", "max_batch/max_seq must cover the example shape")


class ExportToGraph(Transform):
    """``torch.export`` the meta model into a GraphModule (static shapes).

    Buffers go to the meta device for tracing (some architectures mix their
    buffers with parameter outputs); afterwards non-persistent buffers
    (rotary tables) get their real values back, persistent ones stay meta
    until weight loading fills them from the checkpoint.
    """

    name = "export_to_gm"
    stage = Stage.EXPORT
    config_cls = ExportConfig

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        if module is None:
            raise IntegrationError("export_to_gm needs a built model")
        cfg: ExportConfig = self.config  # type: ignore[assignment]
        real: dict[str, torch.Tensor] = {}
        for mname, mod in module.named_modules():
            for bname, buf in list(mod._buffers.items()):
                if buf is None:
                    continue
                if bname in mod._non_persistent_buffers_set and buf.device.type != "meta":
                    real[f"{mname}.{bname}" if mname else bname] = buf
                mod._buffers[bname] = buf.to("meta")
        inputs = ctx.example_inputs(cfg.batch, cfg.seq)
        dynamic = None
        if cfg.dynamic:
            from torch.export import Dim

            dynamic = ({0: Dim("batch", min=1, max=cfg.max_batch), 1: Dim("seq", min=1, max=cfg.max_seq)},)
        ep = torch.export.export(module, inputs, dynamic_shapes=dynamic, strict=cfg.strict)
        lifted = ep.graph_signature.lifted_tensor_constants  # not buffers: those get their values back below
        lost = sorted(k for k in lifted if isinstance(ep.constants.get(k), torch.Tensor) and ep.constants[k].is_meta)
        if lost:
            # A tensor made from Python values inside forward on the parameters' device (falcon's
            # ``fused_qkv[..., [-2], :]``) is a meta constant here: its values are gone, and the
            # graph would index with uninitialised memory once the weights are loaded.
            raise IntegrationError(
                f"export made {len(lost)} tensor constant(s) on the meta device, whose "
                f"values are lost (e.g. {lost[:2]}): the model creates tensors on its "
                "parameters' device inside forward, so it cannot be exported before its "
                "weights exist"
            )
        gm = ep.module()
        for qual, value in real.items():
            owner, _, leaf = qual.rpartition(".")
            try:
                sub = gm.get_submodule(owner) if owner else gm
            except AttributeError:
                continue
            if leaf in sub._buffers:
                sub._buffers[leaf] = value
        ctx.info["export"] = {"nodes": len(gm.graph.nodes), "batch": cfg.batch, "seq": cfg.seq}
        return gm


@dataclass(kw_only=True)
class CleanupConfig(TransformConfig):
    device: str = "cpu"
    logits_only: bool = True


class CleanupExport(Transform):
    """Make the exported graph a plain, portable GraphModule.

    Removes export's runtime guards (forward pre-hooks, the ``_guards_fn``
    call and tensor-metadata asserts, all of which pin the trace device),
    points baked device arguments at the target device, returns the logits
    tensor instead of the model-output dataclass, drops dead code, and puts
    the nodes in their canonical order (the same graph, the same bytes).
    """

    name = "cleanup_export"
    stage = Stage.POST_EXPORT
    config_cls = CleanupConfig

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        cfg: CleanupConfig = self.config  # type: ignore[assignment]
        gms = graph_modules(module) if module is not None else []
        if not gms:
            raise IntegrationError("cleanup_export needs a GraphModule (or a wrapper holding one)")
        removed = moved = 0
        for _, gm in gms:
            r, m = self._clean(gm, cfg)
            removed, moved = removed + r, moved + m
        ctx.info["cleanup_export"] = {"removed": removed, "device_args": moved}
        return module  # type: ignore[return-value]

    @staticmethod
    def _clean(gm: fx.GraphModule, cfg: CleanupConfig) -> tuple[int, int]:
        gm._forward_pre_hooks.clear()
        gm._forward_hooks.clear()
        gm._forward_hooks_with_kwargs.clear()
        gm._forward_pre_hooks_with_kwargs.clear()
        removed = 0
        for node in list(gm.graph.nodes):
            drop = (node.op == "call_module" and node.target == "_guards_fn") or (
                node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default
            )
            if drop and not node.users:
                gm.graph.erase_node(node)
                removed += 1
        if hasattr(gm, "_guards_fn"):
            delattr(gm, "_guards_fn")
        moved = replace_devices(gm, cfg.device)
        if cfg.logits_only:
            _logits_only(gm)
        gm.graph.eliminate_dead_code()
        canonicalize(gm)  # export's node order follows the model's Python, sets included
        gm.graph.lint()
        gm.recompile()
        return removed, moved


def _logits_only(gm: fx.GraphModule) -> None:
    """Return the first output leaf (the logits) as a bare tensor."""
    import torch.utils._pytree as pytree

    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = out.args[0]
    if not isinstance(leaves, (list, tuple)) or not leaves:
        return
    out.args = ((leaves[0],),)
    if info is not None:
        codegen.pytree_info = info._replace(out_spec=pytree.tree_structure(torch.empty(0)))


@dataclass(kw_only=True)
class LoadWeightsConfig(TransformConfig):
    device: str = "cpu"
    strict: bool = True


class LoadWeights(Transform):
    """Load the checkpoint through the module's load-state-dict pre-hooks.

    ``assign=True`` replaces the meta parameters; the tensor-parallel hooks
    slice each full checkpoint tensor to this rank's shard on the way in.
    """

    name = "load_weights"
    stage = Stage.WEIGHT_LOADING
    config_cls = LoadWeightsConfig
    code_modules = ("adstore.integration.reference.checkpoint",)

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        from adstore.integration.reference.checkpoint import read_checkpoint

        cfg: LoadWeightsConfig = self.config  # type: ignore[assignment]
        if module is None:
            raise IntegrationError("load_weights needs a module")
        state = read_checkpoint(ctx.checkpoint)
        # Checkpoint names are relative to the exported graph: load each graph
        # child (a wrapper's own prefix is not in the checkpoint).
        targets = graph_modules(module) or [("", module)]
        unexpected: set[str] = set(state)
        for _, gm in targets:
            strict = cfg.strict and len(targets) == 1
            result = gm.load_state_dict(state, strict=strict, assign=True)
            unexpected &= set(result.unexpected_keys)
        still_meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
        still_meta += [n for n, b in module.named_buffers() if b.device.type == "meta"]
        if still_meta:
            raise IntegrationError(f"checkpoint left {len(still_meta)} tensors unloaded, e.g. {still_meta[:3]}")
        module = module.to(cfg.device)
        for _, gm in graph_modules(module):
            if replace_devices(gm, cfg.device):
                gm.recompile()
        ctx.info["load_weights"] = {"tensors": len(state), "unexpected": sorted(unexpected)}
        return module


@dataclass(kw_only=True)
class InitCacheConfig(TransformConfig):
    max_batch_size: int = 8
    max_seq_len: int = 256

    def validate(self, owner: str) -> None:
        if self.max_batch_size < 1 or self.max_seq_len < 1:
            raise ConfigError(f"{owner}.max_batch_size", "sizes must be positive")


class InitCache(Transform):
    """Allocate per-attention-layer KV buffers sized by the runtime settings.

    Uninitialised (``torch.empty``): a KV cache is written before it is read.

    Runtime sizing happens after the cache point, so changing it reuses the
    cached prefix.  The buffers are shaped from the attention nodes' metadata
    when present (local heads and head dim after sharding).
    """

    name = "init_cache"
    stage = Stage.CACHE_INIT
    config_cls = InitCacheConfig

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        cfg: InitCacheConfig = self.config  # type: ignore[assignment]
        if module is None:
            raise IntegrationError("init_cache needs a module")
        layers = 0
        for _, gm in graph_modules(module):
            for node in gm.graph.nodes:
                if node.target is not torch.ops.aten.scaled_dot_product_attention.default:
                    continue
                key = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
                shape = getattr(key, "shape", None)
                if shape is None or len(shape) != 4:
                    continue
                heads, head_dim = int(shape[1]), int(shape[3])
                buf = torch.empty(2, cfg.max_batch_size, heads, cfg.max_seq_len, head_dim, dtype=key.dtype)
                gm.register_buffer(f"kv_cache_{layers}", buf, persistent=False)
                layers += 1
        ctx.info["init_cache"] = {"layers": layers}
        return module


#: The compile stage's backends: the module as is, Inductor through ``torch.compile``, an AOTInductor engine.
BACKENDS = ("eager", "torch_compile", "aoti")


@dataclass(kw_only=True)
class CompileConfig(TransformConfig):
    """``backend``: one of :data:`BACKENDS`.

    ``aoti`` compiles the module into an AOTInductor engine through the
    engine cache and finds it again on a restart from the pipeline's key
    (:mod:`adstore.integration.engine.stage`); ``options`` are Inductor
    options (part of the engine's key); ``custom_ops``: ``keep`` the
    reference custom ops as calls inside the engine, or ``lower`` them to
    ATen first (the collectives stay calls either way).
    """

    backend: str = "eager"
    options: dict = field(default_factory=dict)
    custom_ops: str = "keep"

    def validate(self, owner: str) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"{owner}.backend", f"unknown backend {self.backend!r} ({', '.join(BACKENDS)})")
        if self.custom_ops not in ("keep", "lower"):
            raise ConfigError(f"{owner}.custom_ops", f"expected 'keep' or 'lower', got {self.custom_ops!r}")
        if self.options and self.backend != "aoti":
            raise ConfigError(f"{owner}.options", "Inductor options are taken by the aoti backend only")


class Compile(Transform):
    """Final compilation: ``eager`` runs the GraphModule as is; ``torch_compile`` and ``aoti`` compile it.

    Both compiling backends run as a compile stage
    (:mod:`adstore.integration.engine.stage`) keyed by the cache point:
    ``aoti`` stores an AOTInductor engine, ``torch_compile`` the files
    Inductor wrote (and compiles now, with one call on the graph's example
    inputs under ``no_grad``, instead of at the first call).  ``events``
    holds what the stage did (hit, miss with its reason, save, or the bypass
    that kept the eager module).
    """

    name = "compile"
    stage = Stage.COMPILE
    config_cls = CompileConfig
    code_modules = ("adstore.integration.reference.ops",)

    def __init__(self, config: TransformConfig) -> None:
        super().__init__(config)
        self.events: list[CacheEvent] = []

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        cfg: CompileConfig = self.config  # type: ignore[assignment]
        if module is None:
            raise IntegrationError("compile needs a module")
        if cfg.backend == "eager":
            return module
        return self._staged(module, ctx, cfg)

    def _staged(self, module: nn.Module, ctx: PipelineContext, cfg: CompileConfig) -> nn.Module:
        from adstore.integration.coordination import dist as agree
        from adstore.integration.coordination.dist import Topology
        from adstore.integration.engine.stage import EngineStage, graph_example_inputs

        point = ctx.point
        through = point.through(self.name) if point is not None else []
        prefix = (
            {"key": point.key, "snapshot": point.snapshot}
            if point is not None and point.key and point.snapshot
            else None
        )
        stage = EngineStage(
            backend=cfg.backend,
            root=point.root if point is not None else None,
            remote=point.remote if point is not None else None,
            settings=cfg.options,
            prefix=prefix,
            suffix=[{"name": n, "config": c} for n, c, _ in through],
            code=[cls for _, _, cls in through] or [type(self)],
            decompositions=_reference_decompositions() if cfg.custom_ops == "lower" else None,
            events=self.events,
        )
        try:
            inputs: tuple[torch.Tensor, ...] | None = graph_example_inputs(module)
            why = ""
        except IntegrationError as exc:
            inputs, why = None, str(exc)
        try:
            if not agree.all_true(inputs is not None):  # every rank compiles now, or none
                fallback = "torch.compile at the first call" if cfg.backend == "torch_compile" else "eager"
                self.events.append(
                    CacheEvent(
                        EventKind.BYPASS,
                        reason=Reason.INTEGRATION_ERROR,
                        rank=ctx.rank,
                        world_size=ctx.world_size,
                        detail=f"{why or 'another rank cannot compile'}; {fallback}",
                    )
                )
                if cfg.backend == "torch_compile":
                    return torch.compile(module, dynamic=False)  # type: ignore[return-value]
                return module
            assert inputs is not None
            out = stage.run(module, inputs, Topology(ctx.rank, ctx.world_size))
        finally:
            stage.close()
        ctx.info[self.name] = {
            "backend": cfg.backend,
            "events": [e.to_dict() for e in stage.events],
            "timings": dict(stage.timings),
        }
        return out


def _reference_decompositions() -> dict[Any, Any]:
    """The reference custom ops as their ATen arithmetic (the collectives are calls either way)."""
    from adstore.integration.reference.ops import ATEN_DECOMPOSITIONS

    return dict(ATEN_DECOMPOSITIONS)
