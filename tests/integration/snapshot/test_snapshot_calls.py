"""A restored snapshot is called like the module saved: keyword arguments by name, another scalar refused.

A snapshot keeps the graph's codegen (its argument names and exported
input spec), so the restored ``forward`` binds a call as the saved one did;
an exported graph keeps export's check, which refuses a Python scalar other
than the exported one.  That refusal named the input with a key path torch
could not print: an ``IndexError`` instead of export's message.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from adstore.integration.snapshot import dump_module, load_module

X, Y = torch.ones(2), torch.full((2,), 3.0)


class Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(2), requires_grad=False)

    def forward(self, x, y, s=2.0):
        return (x - y) * s + self.w


def _pair(make) -> tuple[nn.Module, nn.Module]:
    """The module saved (weights loaded) and its restored snapshot (the same weights)."""
    with torch.device("meta"):
        saved = make(Sub())
    restored = load_module(dump_module(saved))
    for m in (saved, restored):
        m.to_empty(device="cpu")
        m.get_parameter("w").data = torch.tensor([1.0, 2.0])
    return saved, restored


def _exported(m: nn.Module) -> fx.GraphModule:
    return torch.export.export(m, (X.to("meta"),), {"y": Y.to("meta"), "s": 2.0}).module()


def _outcome(module: nn.Module, args: tuple, kwargs: dict) -> object:
    try:
        return module(*args, **kwargs).tolist()
    except Exception as exc:  # noqa: BLE001 - the kind of refusal is what is compared
        return type(exc).__name__


@pytest.mark.parametrize(
    "args, kwargs",
    [((X, Y, 3.0), {}), ((), {"y": Y, "x": X, "s": 3.0}), ((), {"s": 3.0, "x": X, "y": Y}), ((X, Y), {})],
    ids=["positional", "keywords", "other-order", "default"],
)
def test_a_restored_graph_binds_as_the_saved_one(args, kwargs):
    saved, restored = _pair(fx.symbolic_trace)
    assert _outcome(restored, args, kwargs) == _outcome(saved, args, kwargs)
    assert isinstance(_outcome(restored, args, kwargs), list)


def test_a_restored_export_binds_keywords_and_refuses_another_scalar_by_name():
    saved, restored = _pair(_exported)
    for kwargs in ({"y": Y, "s": 2.0}, {"s": 2.0, "y": Y}):
        assert _outcome(restored, (X,), kwargs) == _outcome(saved, (X,), kwargs) == [-3.0, -2.0]
    with pytest.raises(AssertionError, match="s == 2.0"):
        saved(X, y=Y, s=3.0)  # export's guard
    with pytest.raises(RuntimeError, match="input at 's' to be equal to 2.0, but got 3.0"):
        restored(X, y=Y, s=3.0)
