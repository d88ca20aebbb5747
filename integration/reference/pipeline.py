"""The reference pipeline: its transforms in stage order, their registry and default options.

Registration is this explicit list; importing a transform module registers
nothing (docs/pipeline-cache.md, "The reference pipeline").  ``default_transforms`` is the
optimizer's configuration for the list, with per-transform overrides.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from adstore.integration.pipeline.cache import PipelineCache
from adstore.integration.pipeline.transforms import Transform, TransformRegistry
from adstore.integration.reference.fusion import FuseLinears
from adstore.integration.reference.patterns import MatchRMSNorm, MatchRoPE, MatchSwiGLU
from adstore.integration.reference.sharding import ShardLinears
from adstore.integration.reference.stages import (
    BuildModel,
    CleanupExport,
    Compile,
    ExportToGraph,
    InitCache,
    LoadWeights,
)
from adstore.store import ConfigError

__all__ = ["DEFAULT_TRANSFORMS", "REFERENCE_TRANSFORMS", "default_transforms", "reference_registry"]

#: Every transform of the reference pipeline, in stage order.
REFERENCE_TRANSFORMS: tuple[type[Transform], ...] = (
    BuildModel,
    ExportToGraph,
    CleanupExport,
    MatchRMSNorm,
    MatchSwiGLU,
    MatchRoPE,
    ShardLinears,
    PipelineCache,
    LoadWeights,
    FuseLinears,
    InitCache,
    Compile,
)

#: The reference pipeline's configuration: every transform with its default options.
DEFAULT_TRANSFORMS: dict[str, dict[str, Any]] = {cls.name: {} for cls in REFERENCE_TRANSFORMS}


def reference_registry() -> TransformRegistry:
    """A new registry holding the reference transforms (add your own to it)."""
    return TransformRegistry(REFERENCE_TRANSFORMS)


def default_transforms(**overrides: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The reference pipeline with per-transform option overrides."""
    out = copy.deepcopy(DEFAULT_TRANSFORMS)
    for name, opts in overrides.items():
        if name not in out:
            raise ConfigError(f"transforms.{name}", "not part of the reference pipeline")
        out[name].update(opts)
    return out
