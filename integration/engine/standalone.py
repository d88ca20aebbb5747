"""The stage's graph through ``torch._inductor.standalone_compile(..., aot=True)``: a warm restart loads, never traces.

``torch.compile`` needs Dynamo to trace the module again in every process
before any cache can answer.  The compile stage holds the FX graph already,
so it hands that graph to Inductor directly: ``standalone_compile`` with
``aot=True`` returns an artifact that serializes to bytes (a pickle of
AOTAutograd's bundled entry, holding the Python wrapper Inductor generated
and the C++ source of each kernel) and loads in another process without
tracing.

The graph is compiled with its weights as inputs (:func:`flat_graph`): the
artifact then holds no tensor of this checkpoint, and a restart runs it on
the module's own tensors, like the ``aoti`` backend's refit.  The artifact
does not hold the kernels' shared objects: on load, Inductor compiles each
kernel whose ``.so`` is not in its cache directory (seconds each), so the
stage stores those files beside it (:mod:`~adstore.integration.engine.inductor`).

Loading the artifact imports ``torch._dynamo`` (torch's loader lives there)
but traces nothing.  Inductor also checks, once per process, which vector
ISA the CPU and compiler support, by loading small probe libraries each in a
fresh Python process (about 0.2 s each, over a second in all): the stage
records those answers with the entry and gives them back on a restore
(:mod:`~adstore.integration.placement.probes`), whose key already pins the
CPU's flags and the compiler.  A call is bound by name as the graph binds
it, and one with other inputs than the compiled ones (shapes, another scalar) goes to
``torch.compile`` of the graph, as the stage did before
(docs/engine-cache.md, "torch_compile: a standalone artifact travels with the entry").
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from adstore.integration.engine.calls import CallBinding, CompiledInput, first_difference
from adstore.integration.errors import IntegrationError

__all__ = ["FlatGraph", "StandaloneModule", "compile_graph", "flat_graph", "load"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlatGraph:
    """A graph whose tensor attributes are leading inputs and whose output is a flat tuple.

    ``weights``: the attribute names lifted, in input order; ``out_spec``: how
    the original graph's output node nests its leaves.
    """

    module: fx.GraphModule
    weights: tuple[str, ...]
    out_spec: Any

    def tensors(self, owner: nn.Module) -> list[torch.Tensor]:
        """``owner``'s lifted tensors, detached (inference: no graph of gradients is compiled or kept)."""
        return [operator.attrgetter(name)(owner).detach() for name in self.weights]


def flat_graph(gm: fx.GraphModule) -> FlatGraph:
    """``gm`` with every tensor it reads by ``get_attr`` lifted to an input, and its output leaves as one tuple.

    Weights as inputs keep this checkpoint's tensors out of the stored
    artifact (the key does not name them); the flat output is what
    ``standalone_compile`` accepts.  The pytree calling convention of an
    exported graph is kept by :class:`StandaloneModule`, not by the graph.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names: list[str] = []
    by_target: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(operator.attrgetter(node.target)(gm), torch.Tensor):
            target = str(node.target)
            if target not in by_target:
                by_target[target] = graph.placeholder(f"_w{len(names)}")
                names.append(target)
            env[node] = by_target[target]
    out_spec = None
    for node in gm.graph.nodes:
        if node in env:
            continue
        if node.op == "output":
            leaves, out_spec = pytree.tree_flatten(node.args[0])
            if not all(isinstance(leaf, fx.Node) for leaf in leaves):
                raise IntegrationError("the graph returns a constant: standalone_compile needs tensor outputs")
            graph.output(tuple(env[leaf] for leaf in leaves))
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    return FlatGraph(fx.GraphModule(gm, graph), tuple(names), out_spec)


def compile_graph(flat: FlatGraph, owner: nn.Module, example_inputs: Sequence[Any]) -> tuple[Any, bytes]:
    """The standalone artifact of ``flat`` for ``example_inputs`` (static shapes), and its serialized form.

    Raises whatever Inductor raises; ``RuntimeError`` when the result cannot
    be serialized (a graph AOTAutograd's cache refuses).
    """
    from torch._inductor import standalone_compile

    inputs = [*flat.tensors(owner), *example_inputs]
    with torch.no_grad():
        artifact: Any = standalone_compile(
            flat.module, inputs, dynamic_shapes="from_example_inputs", options={}, aot=True
        )
    from torch._inductor.codecache import torch_key
    from torch.utils._appending_byte_serializer import BytesWriter

    # ``CompiledArtifact.save``'s binary format (header, torch's build key, artifact), in memory.
    writer = BytesWriter()
    writer.write_bytes(type(artifact).AOT_HEADER)
    writer.write_bytes(torch_key())
    writer.write_bytes(artifact.serialize())
    return artifact, writer.to_bytes()


def load(path: Path) -> Any:
    """The artifact in the file ``path`` (a verified private copy), by torch's own loader; no tracing."""
    from torch._inductor.standalone_compile import CompiledArtifact

    return CompiledArtifact.load(path=str(path), format="binary")


class StandaloneModule(nn.Module):
    """What the stage returns: the compiled artifact, called like the GraphModule it was made from.

    A call is bound as the GraphModule's own ``forward`` binds it
    (:class:`~adstore.integration.engine.calls.CallBinding`: keyword
    arguments by name, through the exported input spec), and runs the
    artifact only when every input is what was compiled: tensors of the same
    dtype, device, sizes and strides, any other value equal and of the same
    type.  Any other call (other shapes, another scalar, an argument the
    graph does not take) goes to ``torch.compile`` of the graph, made on
    first need, which binds and guards as the graph does.  ``graph`` keeps
    the weights (passed to the artifact on every call, so a module moved or
    refit in place is what runs).
    """

    def __init__(self, graph: fx.GraphModule, flat: FlatGraph, compiled: Any, example_inputs: Sequence[Any]) -> None:
        super().__init__()
        self.graph = graph
        self._flat = flat
        self._compiled = compiled
        self._binding = CallBinding.of_graph(graph)
        self._specs = [CompiledInput.of(v) for v in example_inputs]
        self._weights = [CompiledInput.of(t) for t in flat.tensors(graph)]
        self._fallback: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            inputs = self._binding.flatten(args, kwargs)
        except TypeError as exc:  # the graph refuses it too: torch.compile of the graph raises the graph's error
            return self._other_inputs(f"the call does not bind ({exc})", args, kwargs)
        weights = self._flat.tensors(self.graph)
        why = first_difference(self._specs, inputs) or first_difference(self._weights, weights)
        if why is not None:
            return self._other_inputs(why, args, kwargs)
        out = pytree.tree_unflatten(list(self._compiled(*weights, *inputs)), self._flat.out_spec)
        codegen = self.graph.graph._codegen
        return codegen.process_outputs(out) if hasattr(codegen, "pytree_info") else out

    def _other_inputs(self, why: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._fallback is None:
            logger.warning("compile stage: inputs other than the compiled ones (%s); torch.compile serves them", why)
            self._fallback = torch.compile(self.graph, dynamic=False)
        return self._fallback(*args, **kwargs)
