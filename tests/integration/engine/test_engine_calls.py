"""An AOTInductor engine is called like the model it replaced, and refuses inputs it was not compiled for.

The package takes its tensors flat and reads whatever it is given as the
compiled ones: before, ``engine(x=X)`` raised export's keyword error (the
model binds it), and a batch of another size or another dtype returned
numbers read from the wrong memory.  The default run uses the session's one
shared compile of the MLP (conftest.py); a model with two tensors and a
Python scalar goes through the ``aoti`` compile stage, cold and warm (slow).
"""

from __future__ import annotations

import pytest
import torch
from engine_support import X
from torch import fx, nn

from adstore.integration.errors import InputMismatch


def test_a_keyword_argument_binds_by_name(env):
    engine, model = env["engine"], env["model"]
    torch.testing.assert_close(engine(x=X), model(X), rtol=0, atol=0)
    torch.testing.assert_close(engine(X.clone()), model(X), rtol=0, atol=0)
    with pytest.raises(TypeError):
        engine(X, X)  # what the model raises too: one argument too many
    with pytest.raises(TypeError):
        engine(inp=X)


@pytest.mark.parametrize(
    "other", [X[:2], X.double(), X.t().contiguous().t(), torch.ones(4, 16, dtype=torch.int64)], ids=str
)
def test_inputs_other_than_the_compiled_ones_are_refused(env, other):
    with pytest.raises(InputMismatch) as info:
        env["engine"](other)
    assert info.value.reason == "engine_mismatch" and "input 0" in str(info.value)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0]), requires_grad=False)

    def forward(self, x, y, s):  # no annotations: FX would keep this module's string annotations as globals
        return (x - y) * s + self.w


@pytest.mark.slow  # one AOTInductor compile
def test_the_aoti_stage_binds_keywords_and_refuses_another_scalar(tmp_path):
    from adstore.integration.coordination.dist import Topology
    from adstore.integration.engine.stage import EngineStage

    x, y = torch.ones(2), torch.full((2,), 3.0)
    gm = fx.symbolic_trace(Scaled())
    modules = []
    for _ in ("cold", "warm"):
        prefix = {"key": "e" * 64, "snapshot": "f" * 64}
        stage = EngineStage(root=str(tmp_path / "store"), backend="aoti", prefix=prefix)
        try:
            modules.append(stage.run(gm, [x, y, 2.0], Topology(0, 1)))
        finally:
            stage.close()
        assert type(modules[-1]).__name__ == "EngineModule", stage.events
    assert [e.kind for e in stage.events] == ["hit"]
    want = gm(x, y, 2.0)  # [-3., -2.]
    for module in modules:
        torch.testing.assert_close(module(y=y, x=x, s=2.0), want)
        torch.testing.assert_close(module(x, s=2.0, y=y), want)
        with pytest.raises(InputMismatch, match="value 2.0, got 3.0"):
            module(x, y, 3.0)  # the engine computes with 2.0: refused, never [-3., -2.] for [-5., -4.]
        with pytest.raises(InputMismatch):
            module(x, y, 2)  # an int, though equal
