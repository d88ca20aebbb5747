"""Names a snapshot supplies are ASCII: identifiers, digit parts of module paths, hook scopes, symbols.

``str.isidentifier`` takes ``ｘ`` (which Python reads as ``x`` once it is
source, NFKC) and ``str.isdigit`` takes ``²``; a hostile payload uses them to
pass the checks with names that are not the ones the graph or the module has.
"""

from __future__ import annotations

import pytest
import torch

from adstore.integration.errors import CorruptSnapshot
from adstore.integration.snapshot.hooks import TPShardHook, collect_hook_specs, reattach_hooks
from adstore.integration.snapshot.names import attr_path, identifier, member_name
from adstore.integration.snapshot.tensor_meta import SymDecoder

HOSTILE = ["ｘ", "x\u0301", "ℌ"]  # str.isidentifier() takes each: fullwidth, a combining accent, a letterlike symbol


@pytest.mark.parametrize("name", HOSTILE)
def test_an_identifier_is_ascii(name):
    assert identifier("x_1", "node") == "x_1"
    with pytest.raises(CorruptSnapshot):
        identifier(name, "node")


@pytest.mark.parametrize("name", ["²", "１", "٣", "ｘ"])
def test_a_member_name_is_an_ascii_identifier_or_ascii_digits(name):
    assert member_name("0", "submodule") == "0" and member_name("x_1", "submodule") == "x_1"
    assert attr_path("layers.0.weight", "target") == "layers.0.weight"
    with pytest.raises(CorruptSnapshot):
        member_name(name, "submodule")
    with pytest.raises(CorruptSnapshot):
        attr_path(f"layers.{name}.weight", "target")


def test_a_hook_scope_is_a_path_of_ascii_names():
    m = torch.nn.Module()
    m.add_module("²", torch.nn.Linear(8, 8))  # torch takes the name; a snapshot's scope may not name it
    m.get_submodule("²")._register_load_state_dict_pre_hook(TPShardHook("weight", (8, 8), 0, 0, 2))
    (spec,) = collect_hook_specs(m)
    assert spec["scope"] == "²"
    with pytest.raises(CorruptSnapshot):
        reattach_hooks(_with("²"), [spec])


def _with(name: str) -> torch.nn.Module:
    m = torch.nn.Module()
    m.add_module(name, torch.nn.Linear(8, 8))
    return m


@pytest.mark.parametrize("name", ["ｓ0", "s٣"])
def test_a_symbol_name_is_an_ascii_identifier(name):
    with pytest.raises(CorruptSnapshot):
        SymDecoder({name: {"hint": 4}})
