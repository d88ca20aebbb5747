"""The ``torch_compile`` stage's two paths, in one process: ``standalone_compile`` and the ``torch.compile`` fallback.

A graph ``standalone_compile`` serves is stored as its artifact plus one blob
per shared object, and restores by loading the artifact (no Dynamo frame
traced, no kernel built); a call with other shapes than the compiled ones is
served by ``torch.compile`` of the graph.  A graph it cannot serve (one that
returns a constant) is compiled by ``torch.compile``, the reason is in the
event, and its Inductor files are stored as one bundle that restores.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import fx, nn

from adstore.integration.engine import inductor
from adstore.integration.reference.stages import CleanupConfig, CleanupExport
from adstore.integration.validity.keys import CacheKey
from adstore.store import Store

pytestmark = pytest.mark.slow  # two Inductor compiles


class Block(nn.Module):
    def __init__(self, constant_out: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(8), requires_grad=False)
        self.constant_out = constant_out

    def forward(self, x: torch.Tensor):
        y = torch.relu(nn.functional.linear(x, self.weight, self.bias)) * 2.0
        return (y, 3) if self.constant_out else (y, y.sum(-1))


@dataclass
class Stage:
    """What ``inductor.compile``/``restore`` ask of the compile stage: its store."""

    root: str

    def store(self) -> Store:
        return Store.open(self.root)


def traced(constant_out: bool) -> fx.GraphModule:
    """The block as the pipeline hands it to the stage: exported, export's guards removed."""
    torch.manual_seed(0)
    gm = torch.export.export(Block(constant_out), (torch.randn(4, 16),)).module()
    CleanupExport._clean(gm, CleanupConfig(logits_only=False))
    return gm


def frames() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["frames"].values()))


def test_a_graph_standalone_compile_serves_restores_without_tracing(tmp_path):
    stage, key = Stage(str(tmp_path / "store")), CacheKey("a" * 64, {"stage": "torch_compile"})
    x = torch.randn(4, 16)
    compiled, event = inductor.compile(stage, traced(False), [x], key)
    assert event.kind == "save" and event.detail.startswith("standalone_compile"), event
    with Store.open(stage.root) as store:
        (manifest,) = store.manifests(key.key)
        kernels = [name for name in manifest.artifacts if name.startswith("cache.")]
        assert inductor.STANDALONE in manifest.artifacts and kernels, sorted(manifest.artifacts)

    torch._dynamo.reset()
    traced_before = frames()
    fresh = traced(False)
    restored = inductor.restore(stage, fresh, key, [x])[0]
    assert restored is not None
    module, hit = restored
    assert hit.kind == "hit" and "0 shared objects built" in hit.detail, hit
    assert type(module).__name__ == "StandaloneModule"
    with torch.no_grad():
        got, want = module(x), fresh(x)
    assert frames() == traced_before  # loaded, not traced
    torch.testing.assert_close(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got, compiled(x), strict=True))

    other = torch.randn(3, 16)  # not the compiled shape: torch.compile of the graph serves it
    with torch.no_grad():
        torch.testing.assert_close(module(other), fresh(other))


def test_a_graph_standalone_compile_cannot_serve_is_compiled_by_torch_compile_and_bundled(tmp_path):
    stage, key = Stage(str(tmp_path / "store")), CacheKey("b" * 64, {"stage": "torch_compile"})
    x = torch.randn(4, 16)
    compiled, event = inductor.compile(stage, traced(True), [x], key)
    assert event.kind == "save" and "standalone_compile failed" in event.detail and "constant" in event.detail
    with Store.open(stage.root) as store:
        (manifest,) = store.manifests(key.key)
        assert set(manifest.artifacts) == {inductor.ARTIFACT}

    torch._dynamo.reset()
    fresh = traced(True)
    restored = inductor.restore(stage, fresh, key, [x])[0]
    assert restored is not None
    module, hit = restored
    assert hit.kind == "hit" and "fxgraph_cache_hit 1" in hit.detail, hit
    with torch.no_grad():
        got = module(x)
    assert torch.equal(got[0], compiled(x)[0]) and got[1] == 3


class Scaled(nn.Module):
    """A graph whose Python scalar is an input: ``standalone_compile`` specialises the example's value."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0]), requires_grad=False)

    def forward(self, x, y, s):  # no annotations: FX would keep this module's string annotations as globals
        return (x - y) * s + self.w


def test_keywords_in_another_order_and_another_scalar_answer_as_the_graph(tmp_path):
    """Through the stage, cold (compiled) and warm (loaded): ``m(y=y, x=x, s=2.0)`` is ``m(x, y, 2.0)``, and
    ``s=3.0`` (the artifact holds 2.0) is served by ``torch.compile`` of the graph, as the graph answers it."""
    from adstore.integration.coordination.dist import Topology
    from adstore.integration.engine.stage import EngineStage

    x, y = torch.ones(2), torch.full((2,), 3.0)
    gm = fx.symbolic_trace(Scaled())
    modules = []
    for _ in ("cold", "warm"):
        torch._dynamo.reset()
        stage = EngineStage(
            root=str(tmp_path / "store"), backend="torch_compile", prefix={"key": "c" * 64, "snapshot": "d" * 64}
        )
        try:
            modules.append(stage.run(gm, [x, y, 2.0], Topology(0, 1)))
        finally:
            stage.close()
        assert type(modules[-1]).__name__ == "StandaloneModule", stage.events
    assert [e.kind for e in stage.events] == ["hit"]
    with torch.no_grad():
        for module in modules:
            torch.testing.assert_close(module(y=y, x=x, s=2.0), gm(x, y, 2.0))  # [-3., -2.]
            torch.testing.assert_close(module(x, s=2.0, y=y), gm(x, y, 2.0))
            assert module._fallback is None
            torch.testing.assert_close(module(x, y, 3.0), gm(x, y, 3.0))  # [-5., -4.], not the artifact's 2.0
            torch.testing.assert_close(module(x, y, s=2), gm(x, y, 2))  # an int, though equal: the graph's answer
