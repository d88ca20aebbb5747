"""The engine hash: what changes it (graph, shapes, settings), what does not (names, weights, processes).

Re-exports, renamed inputs and plain FX graph modules share a hash; shapes,
dynamic dimensions, settings and arguments do not; hashing never touches
parameters, the hash is the same in another process, and bad settings are
clear errors before any compile.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from engine_support import MLP, MLPRenamed, X, digests, make_model

from adstore.integration.engine.cache import compile
from adstore.integration.engine.hashing import get_hash, hash_components
from adstore.integration.engine.storage import MemoryEngineStorage
from adstore.integration.errors import ConfigError


def test_hash_equal_on_reexport_and_matches_compile(env):
    a = get_hash(torch.export.export(make_model(1), (X,)), (X,))
    b = get_hash(torch.export.export(make_model(9), (X,)), (X,))
    assert a == b == env["hash"]


def test_hash_differs_on_shape_setting_and_arguments():
    base_ep = torch.export.export(make_model(1), (X,))
    base = get_hash(base_ep, (X,))
    x8 = torch.randn(8, 16)
    assert get_hash(torch.export.export(make_model(1), (x8,)), (x8,)) != base
    assert get_hash(base_ep, (X,), settings={"cpp.simdlen": 8}) != base
    assert get_hash(base_ep, (X,), settings={"max_autotune": True}) != base
    assert MLP(hidden=64) is not None and get_hash(torch.export.export(MLP(hidden=64).eval(), (X,)), (X,)) != base

    class Leaky(torch.nn.Module):
        def __init__(self, slope: float, dim: int) -> None:
            super().__init__()
            self.slope, self.dim = slope, dim

        def forward(self, x):
            return torch.nn.functional.leaky_relu(x, self.slope).sum(self.dim)

    def h(slope, dim):
        ep = torch.export.export(Leaky(slope, dim), (X,))
        return get_hash(ep, (X,)), [str(n.target) for n in ep.graph.nodes]

    (h1, ops1), (h2, ops2), (h3, ops3) = h(0.1, 0), h(0.2, 0), h(0.1, 1)
    assert ops1 == ops2 == ops3, "the test needs graphs with the same op sequence"
    assert len({h1, h2, h3}) == 3


def test_isomorphic_graphs_with_renamed_inputs_share():
    a = torch.export.export(make_model(1), (X,))
    b = torch.export.export(MLPRenamed().eval(), (X,))
    assert [n.name for n in a.graph.nodes if n.op == "placeholder"][-1] == "x"
    assert [n.name for n in b.graph.nodes if n.op == "placeholder"][-1] == "inp"
    assert get_hash(a, (X,)) == get_hash(b, (X,))


def test_dynamic_shapes_are_in_the_hash_and_renaming_still_shares():
    batch = torch.export.Dim("batch", min=2, max=64)
    x8 = torch.randn(8, 16)
    a = get_hash(
        torch.export.export(make_model(1), (X,), dynamic_shapes=({0: batch},)), (X,), dynamic_shapes=({0: batch},)
    )
    b = get_hash(
        torch.export.export(MLPRenamed().eval(), (x8,), dynamic_shapes=({0: batch},)),
        (x8,),
        dynamic_shapes=({0: batch},),
    )
    narrow = torch.export.Dim("batch", min=2, max=16)
    c = get_hash(
        torch.export.export(make_model(1), (X,), dynamic_shapes=({0: narrow},)), (X,), dynamic_shapes=({0: narrow},)
    )
    static = get_hash(torch.export.export(make_model(1), (X,)), (X,))
    assert a == b and a != c and a != static


def test_hashing_and_compiling_never_touch_parameters(env):
    assert digests(env["model"]) == env["before"]  # after the fixture's compile
    model = make_model(11)
    before = digests(model)
    ep = torch.export.export(model, (X,))
    ep_before = {k: v.clone() for k, v in ep.state_dict.items()}
    get_hash(ep, (X,))
    get_hash(model, (X,))
    hash_components(ep.graph_module, (X,))
    assert digests(model) == before
    assert all(torch.equal(ep.state_dict[k], v) for k, v in ep_before.items())
    assert all(t.abs().sum() > 0 for t in model.state_dict().values())


def test_bad_settings_are_clear_errors_before_any_compile(env):
    with pytest.raises(ConfigError):
        compile(env["model"], (X,), engine_cache=MemoryEngineStorage(), freezing=True)
    with pytest.raises(ConfigError):
        compile(env["model"], (X,), engine_cache=MemoryEngineStorage(), **{"not.an_option": 1})
    with pytest.raises(ConfigError):
        compile(env["model"], (X,), engine_cache=MemoryEngineStorage(), always_keep_tensor_constants=False)


def test_hash_is_stable_across_processes(env):
    import subprocess
    import sys

    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from engine_support import MLPRenamed, X
        from adstore.integration.engine.hashing import get_hash
        print(get_hash(torch.export.export(MLPRenamed().eval(), (X,)), (X,)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == env["hash"]


def test_plain_graph_modules_hash_by_structure_not_weights():
    class Net(torch.nn.Module):
        def __init__(self, out: int) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, out)

        def forward(self, x):
            return torch.relu(self.lin(x)) * 2.0

    a = torch.fx.symbolic_trace(Net(8))
    b = torch.fx.symbolic_trace(Net(8))
    c = torch.fx.symbolic_trace(Net(4))
    before = {k: v.clone() for k, v in a.state_dict().items()}
    assert not torch.equal(a.lin.weight, b.lin.weight)
    assert get_hash(a, (X,)) == get_hash(b, (X,)) != get_hash(c, (X,))
    assert get_hash(a, (X,)) != get_hash(a, (torch.randn(2, 16),))  # no graph meta: example shapes count
    assert all(torch.equal(a.state_dict()[k], v) for k, v in before.items())
