"""A compiled module is called like the module it replaced: keyword arguments by name, other values elsewhere.

The compile stage's :class:`StandaloneModule` runs flat inputs; it must bind
a call as its GraphModule's ``forward`` does (by name, through an exported
graph's input spec) and run the artifact only for the inputs it was
compiled for.  Here the artifact's calling convention is served by the flat
graph itself (``flat_graph(gm).module``, what ``standalone_compile``
compiles), so no compile is needed; the real artifact, a different scalar
and the ``torch.compile`` fallback are in test_compile_stage_standalone.py
(slow).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from adstore.integration.engine.calls import CallBinding, CompiledInput, first_difference
from adstore.integration.engine.standalone import StandaloneModule, flat_graph


class Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0]), requires_grad=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor, s: float = 2.0) -> torch.Tensor:
        return (x - y) * s + self.w


X, Y = torch.ones(2), torch.full((2,), 3.0)


def exported() -> fx.GraphModule:
    """Export's GraphModule (pytree codegen, ``y`` exported as a keyword), its input check removed as the
    pipeline's cleanup removes it."""
    gm = torch.export.export(Sub(), (X,), {"y": Y}).module()
    gm._forward_pre_hooks.clear()
    return gm


def traced() -> fx.GraphModule:
    return fx.symbolic_trace(Sub())


@pytest.mark.parametrize("make", [exported, traced], ids=["exported", "traced"])
def test_keyword_arguments_in_another_order_reach_the_inputs_they_name(make):
    gm = make()
    flat = flat_graph(gm)
    example = CallBinding.of_graph(gm).flatten((X,), {"y": Y})
    module = StandaloneModule(gm, flat, flat.module, example)
    want = gm(X, y=Y)
    for args, kwargs in [((X,), {"y": Y}), ((), {"y": Y, "x": X}), ((X, Y), {})]:
        got = module(*args, **kwargs)
        torch.testing.assert_close(got, want, msg=f"called with {len(args)} positional, keywords {list(kwargs)}")
    assert module._fallback is None  # every one of these is the compiled call


def test_a_lazy_graph_module_binds_by_its_generated_forward():
    """A restored snapshot or a recompiled pipeline graph is lazy: ``forward(*args, **kwargs)`` until its first
    call.  Bound on that stand-in, every call missed the artifact (``[(), {...}]`` for two inputs)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    gm = exported()
    lazy = _LazyGraphModule(gm, gm.graph)
    lazy.graph._codegen = gm.graph._codegen
    lazy.recompile()  # lazy: the code is generated at the first call
    assert lazy._needs_recompile()
    binding = CallBinding.of_graph(lazy)
    assert binding.names == ("x", "y") and binding.flatten((), {"y": Y, "x": X}) == [X, Y]
    again = _LazyGraphModule(gm, gm.graph)  # an engine made from a lazy module binds by its names too
    again.graph._codegen = gm.graph._codegen
    again.recompile()
    in_spec = torch.export.export(Sub(), (X, Y)).call_spec.in_spec
    engine_binding = CallBinding.of_model(again, in_spec)
    assert engine_binding is not None and engine_binding.flatten((), {"y": Y, "x": X}) == [X, Y]


def test_the_binding_follows_python_and_the_exported_spec():
    binding = CallBinding.of_graph(exported())
    assert binding.names == ("x", "y")
    assert [t.tolist() for t in binding.flatten((), {"y": Y, "x": X})] == [X.tolist(), Y.tolist()]
    with pytest.raises(TypeError):
        binding.flatten((X,), {"y": Y, "z": Y})  # an argument the graph does not take: the graph's TypeError
    with pytest.raises(TypeError):
        binding.flatten((), {"y": Y})  # a missing one
    traced_binding = CallBinding.of_graph(traced())
    assert traced_binding.flatten((X, Y), {}) == [X, Y, 2.0]  # the default, as the graph fills it
    assert traced_binding.flatten((), {"s": 3.0, "y": Y, "x": X}) == [X, Y, 3.0]


def test_other_values_are_not_the_compiled_inputs():
    specs = [CompiledInput.of(X), CompiledInput.of(2.0)]
    assert first_difference(specs, [torch.zeros(2), 2.0]) is None
    assert "value 2.0, got 3.0" in first_difference(specs, [X, 3.0])
    assert "got 2" in first_difference(specs, [X, 2])  # another type, though equal
    assert "sizes [2], got [3]" in first_difference(specs, [torch.ones(3), 2.0])
    assert "torch.float64" in first_difference(specs, [X.double(), 2.0])
    assert "strides" in first_difference([CompiledInput.of(torch.ones(2, 3))], [torch.ones(3, 2).t()])
    assert first_difference([CompiledInput.of(torch.ones(1, 3))], [torch.ones(3, 1).t()]) is None  # size-1 dim
    assert first_difference([CompiledInput.of(torch.ones(2, 3), dynamic=[True, False])], [torch.ones(5, 3)]) is None
    assert "3 inputs" not in (first_difference(specs, [X]) or "")
    assert first_difference(specs, [X]) == "2 inputs were compiled, the call has 1"
