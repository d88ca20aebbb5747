"""One engine request: the model exported, its architecture hashed, its weights split from its code.

The engine cache (:mod:`adstore.integration.engine.cache`) works on a
:class:`Request`: both the hit and the miss path need the same exported
program, hash, weights and constants, made once per ``compile``/``lookup``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from adstore.integration.engine.calls import CallBinding
from adstore.integration.engine.hashing import as_tuple, hash_components
from adstore.integration.engine.runtime import (
    CompiledEngine,
    code_constant_names,
    constants_as_buffers,
    constants_spec,
    weights_of,
)
from adstore.integration.errors import CacheKeyError
from adstore.integration.validity.keys import json_digest
from adstore.integration.validity.toolchain import effective_inductor_configs

__all__ = ["Request", "prepare"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Request:
    """One compile/lookup request after export and hashing."""

    ep: torch.export.ExportedProgram
    hash: str | None
    components: Mapping[str, Any]
    weights: dict[str, torch.Tensor]
    spec: list[dict[str, Any]]
    inductor_configs: dict[str, Any]
    code_consts: dict[str, torch.Tensor]
    timings: dict[str, float]
    start: float
    inputs: tuple[Any, ...] = ()
    binding: CallBinding | None = None

    def engine(self, runner: Any, **fields: Any) -> CompiledEngine:
        """The engine of this request: ``runner``, called like the model (its binding, checked against its inputs)."""
        return CompiledEngine(
            runner, code_constants=self.code_consts, binding=self.binding, example_inputs=self.inputs, **fields
        )


def prepare(model: Any, example_inputs: Any, dynamic_shapes: Any, settings: Mapping[str, Any]) -> Request:
    """Export ``model`` (unless it is a program), hash its architecture and split its weights from its code constants.

    A graph that cannot be hashed gets ``hash=None`` (a bypass, logged); bad settings raise
    :class:`~adstore.integration.errors.ConfigError`, and anything but a module or a program ``TypeError``.
    """
    start = time.perf_counter()
    example_inputs = as_tuple(example_inputs)
    inductor_configs = effective_inductor_configs(settings)  # bad settings: a clear ConfigError
    if isinstance(model, torch.export.ExportedProgram):
        ep = model
    elif isinstance(model, torch.nn.Module):
        ep = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
    else:
        raise TypeError(f"compile() takes an nn.Module or ExportedProgram, got {type(model).__name__}")
    export_seconds = time.perf_counter() - start
    h: str | None
    t_hash = time.perf_counter()
    try:
        components = hash_components(ep, example_inputs, settings=settings, dynamic_shapes=dynamic_shapes)
        h = json_digest(components)
    except CacheKeyError as exc:
        logger.warning("engine cache bypass (%s): %s", exc.reason, exc)
        h, components = None, {}
    code_names = set(code_constant_names(ep))
    code_consts = {k: v for k, v in weights_of(ep).items() if k in code_names}
    ep = constants_as_buffers(ep)
    weights = weights_of(ep)
    return Request(
        ep=ep,
        hash=h,
        components=components,
        weights=weights,
        spec=constants_spec(weights),
        inductor_configs=inductor_configs,
        code_consts=code_consts,
        timings={"export": export_seconds, "hash": time.perf_counter() - t_hash},
        start=start,
        inputs=example_inputs,
        binding=CallBinding.of_model(model, ep.call_spec.in_spec),
    )
