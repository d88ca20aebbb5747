"""The transform framework: stages, typed configs, the context, the registry, the cache point.

A transform is a class with a ``name``, a :class:`Stage`, and a typed config
dataclass.  Configs are validated when parsed: an unknown option or a wrongly
typed value is a :class:`ConfigError`, because a silently ignored option would
also be silently missing from the cache key (docs/pipeline-cache.md, "The reference pipeline").

Transforms are registered explicitly: a :class:`TransformRegistry` is built
from a list (the reference pipeline has one), never by importing a module for
its side effects.  The optimizer knows the cache
transform only through the :class:`CachePoint` protocol.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from adstore.store import ConfigError

__all__ = [
    "AfterPoint",
    "CachePoint",
    "ModelSource",
    "PipelineContext",
    "Stage",
    "Transform",
    "TransformConfig",
    "TransformRegistry",
]


class Stage(enum.IntEnum):
    """Pipeline stages in run order; transforms are sorted by stage."""

    BUILD_MODEL = 0
    EXPORT = 1
    POST_EXPORT = 2
    PATTERN_MATCHING = 3
    SHARDING = 4
    WEIGHT_LOADING = 5
    POST_LOAD_FUSION = 6
    CACHE_INIT = 7
    COMPILE = 8

    @classmethod
    def parse(cls, value: str | int | Stage) -> Stage:
        if isinstance(value, Stage):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ConfigError("stage", f"unknown stage {value!r}; stages: {[s.name.lower() for s in cls]}")


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """Validate (and lightly normalise) ``value`` against a simple annotation."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in typing.get_args(tp):
            try:
                return _check_type(value, arm, where)
            except ConfigError as exc:
                errors.append(exc.why)
        raise ConfigError(where, f"{value!r} matches none of {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(where, f"expected None, got {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(where, f"expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        out = [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(where, f"expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(where, f"expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(where, f"expected an integer, got {value!r}")
        return value
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(where, f"expected {tp.__name__}, got {type(value).__name__}")
        return value
    return value


@dataclass(kw_only=True)
class TransformConfig:
    """Base of every transform config; ``enabled=False`` skips the transform."""

    enabled: bool = True

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, *, owner: str = "transform") -> TransformConfig:
        data = dict(data or {})
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ConfigError(f"{owner}.{unknown[0]}", f"unknown option(s) {unknown}; allowed: {sorted(fields)}")
        values = {k: _check_type(v, hints[k], f"{owner}.{k}") for k, v in data.items()}
        cfg = cls(**values)
        cfg.validate(owner)
        return cfg

    def validate(self, owner: str) -> None:
        """Cross-field checks; subclasses raise :class:`ConfigError`."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ModelSource(Protocol):
    """What the pipeline needs from a model factory (the reference one is ``ModelFactory``)."""

    def identity(self) -> Mapping[str, Any]:
        """The ``model`` component of the cache key."""

    def build(self, *, device: str = ...) -> nn.Module:
        """A fresh module (on the meta device for the pipeline)."""

    def example_inputs(self, *, batch: int, seq: int) -> tuple[torch.Tensor, ...]:
        """Inputs to trace with."""


@dataclass
class AfterPoint:
    """What the transforms after a cache point know of it (``PipelineContext.point``).

    A stage after the point that caches what it makes (the compile stage's
    engine) keys it by the point's ``key``, the digest of the ``snapshot``
    restored or saved there, and the configuration and code of the
    ``transforms`` from the point through itself; ``root`` and ``remote``
    are the point's store and remote tier.
    """

    key: str | None = None
    snapshot: str | None = None
    root: str | None = None
    remote: str | None = None
    #: Enabled transforms after the point in run order: name, config copy (taken before anything ran), class.
    transforms: list[tuple[str, dict[str, Any], type]] = field(default_factory=list)

    def through(self, name: str) -> list[tuple[str, dict[str, Any], type]]:
        """The transforms after the point up to and including ``name``."""
        out: list[tuple[str, dict[str, Any], type]] = []
        for item in self.transforms:
            out.append(item)
            if item[0] == name:
                break
        return out


@dataclass
class PipelineContext:
    """What every transform may read: the factory, checkpoint and topology.

    ``info`` collects per-transform results (match counts, sharded layers).
    A restored module has no context from the prefix, so transforms after the
    cache point read only the module, their own config and ``point``
    (what the optimizer tells them of the cache point; None without one).
    """

    factory: ModelSource
    checkpoint: Path
    rank: int = 0
    world_size: int = 1
    info: dict[str, Any] = field(default_factory=dict)
    point: AfterPoint | None = None

    def example_inputs(self, batch: int, seq: int) -> tuple[torch.Tensor, ...]:
        return self.factory.example_inputs(batch=batch, seq=seq)


class Transform:
    """A pipeline step; subclasses set ``name``, ``stage``, ``config_cls``, ``apply``.

    ``code_modules`` names extra modules whose source belongs to this
    transform's code fingerprint (helpers it calls that live elsewhere).
    """

    name: ClassVar[str] = ""
    stage: ClassVar[Stage] = Stage.BUILD_MODEL
    config_cls: ClassVar[type[TransformConfig]] = TransformConfig
    code_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: TransformConfig) -> None:
        self.config = config

    def apply(self, module: nn.Module | None, ctx: PipelineContext) -> nn.Module:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


class TransformRegistry:
    """Transform classes by name, built from an explicit list (docs/pipeline-cache.md, "The reference pipeline").

    Adding a class under a name already present replaces it (the last one wins),
    so a caller can swap one step of a pipeline for their own.
    """

    def __init__(self, transforms: Iterable[type[Transform]] = ()) -> None:
        self._classes: dict[str, type[Transform]] = {}
        for cls in transforms:
            self.add(cls)

    def add(self, cls: type[Transform]) -> type[Transform]:
        """Register ``cls`` under its ``name``; returns it (usable as a class decorator)."""
        if not cls.name:
            raise ConfigError("transform", f"{cls.__qualname__} has no name")
        self._classes[cls.name] = cls
        return cls

    def get(self, name: str) -> type[Transform]:
        try:
            return self._classes[name]
        except KeyError:
            raise ConfigError(f"transforms.{name}", f"unknown transform; registered: {sorted(self._classes)}") from None

    def copy(self) -> TransformRegistry:
        return TransformRegistry(self._classes.values())

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)


@runtime_checkable
class CachePoint(Protocol):
    """A transform an optimizer treats as its cache point (docs/pipeline-cache.md, "The CachePoint protocol").

    This is the whole contract between an optimizer and the cache; the
    reference :class:`~adstore.integration.pipeline.optimizer.InferenceOptimizer`
    finds it with ``isinstance(t, CachePoint)`` and uses nothing else, and a third-party optimizer drives
    :class:`~adstore.integration.pipeline.cache.PipelineCache` the same way::

        cache = PipelineCache(PipelineCache.config_cls.from_dict({"root": root}))
        ctx = PipelineContext(factory=source, checkpoint=ckpt_dir, rank=r, world_size=n)
        # 1. bind the prefix: (name, config copy) pairs taken before anything ran
        cache.bind([(t.name, copy.deepcopy(t.config.to_dict())) for t in prefix], [type(t) for t in prefix])
        # 2. ask to restore before running anything
        module = cache.restore(ctx)
        if module is None:
            t0 = time.perf_counter()
            module = run(prefix)                                    # your transforms
            # 3. save at the cache point (returns the module unchanged)
            module = cache.save(module, ctx, prefix_seconds=time.perf_counter() - t0)
        module = run(suffix, module)                                # weights, fusion, compile
        cache.events                                                # what happened, as CacheEvents

    ``ctx.factory`` is any :class:`ModelSource` (only ``identity()`` is read
    for the key) and ``ctx.checkpoint`` a safetensors file or directory.
    Members:

    * :attr:`cache_stage`: the point runs at the end of this stage (it sorts
      after every transform of the stage; at most ``Stage.SHARDING``);
    * :meth:`bind`: the prefix (transforms before the point, as names plus
      config copies taken before any transform ran, and their classes, whose
      source is fingerprinted into the key);
    * :meth:`restore`: before anything runs; a module means "resume after me",
      None means "run the prefix"; every rank gets the same answer;
    * :meth:`save`: at the cache point on a miss, with the seconds the prefix
      took; returns the module unchanged; never raises for a cache problem;
    * :meth:`key` and :attr:`events`: this run's key and what the point did.

    ``restore`` and ``save`` are collectives under an initialised process
    group: every rank calls them at the same point.
    """

    config: TransformConfig
    events: list[Any]

    @property
    def cache_stage(self) -> Stage: ...

    def bind(self, prefix: Sequence[tuple[str, dict[str, Any]]], prefix_classes: Sequence[type]) -> None: ...

    def key(self, ctx: PipelineContext) -> Any: ...

    def restore(self, ctx: PipelineContext) -> nn.Module | None: ...

    def save(self, module: nn.Module, ctx: PipelineContext, *, prefix_seconds: float) -> nn.Module: ...
