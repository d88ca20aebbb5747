"""Cache keys: canonical JSON, component diffs, code fingerprints."""

from __future__ import annotations

import enum
import importlib
import math
from pathlib import Path, PurePosixPath

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adstore.integration.errors import CacheKeyError
from adstore.integration.validity.keys import (
    FORMAT_VERSION,
    build_key,
    canonical,
    canonical_json,
    code_fingerprint,
    diff_components,
    env_component,
)

BASE = dict(
    model={"arch": "llama"},
    checkpoint={"files": []},
    prefix=[{"name": "export", "config": {"seq": 8}}],
    dist=None,
    env={"adstore_format": 1},
    extra={},
)


class Color(enum.Enum):
    RED = "red"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=6), json_values, max_size=6))
def test_canonical_json_ignores_insertion_order_and_round_trips(d):
    reordered = dict(reversed(list(d.items())))
    assert canonical_json(d) == canonical_json(reordered)
    import json

    assert canonical(json.loads(canonical_json(d))) == canonical(d)


def test_canonical_forms():
    assert canonical_json({"b": 1, "a": 2}) == '{"a":2,"b":1}'
    assert canonical(0.1) == 0.1 and canonical_json(0.1) == "0.1"
    assert canonical_json(1e-6) != canonical_json(1e-5)
    assert canonical(math.inf) == {"__float__": "inf"}
    assert canonical(PurePosixPath("/a/b")) == "/a/b" and canonical(Path("x/y")) == "x/y"
    assert canonical(Color.RED) == "red"
    assert canonical((1, 2)) == [1, 2]
    assert canonical({3, 1, 2}) == [1, 2, 3]
    assert canonical(torch.float16) == "torch.float16" and canonical(torch.device("cpu")) == "cpu"
    with pytest.raises(CacheKeyError):
        canonical({"f": object()})
    with pytest.raises(CacheKeyError):
        canonical({(1, 2): "tuple key"})


def test_key_is_stable_and_components_name_the_difference():
    a = build_key(**BASE)
    assert a.key == build_key(**BASE).key and len(a.key) == 64
    b = build_key(**{**BASE, "prefix": [{"name": "export", "config": {"seq": 16}}]})
    c = build_key(**{**BASE, "dist": {"world_size": 2}})
    d = build_key(**{**BASE, "extra": {"tag": "x"}})
    assert len({a.key, b.key, c.key, d.key}) == 4
    assert diff_components(a.components, b.components) == ["prefix"]
    assert diff_components(a.components, c.components) == ["dist"]
    assert diff_components(a.components, d.components) == ["extra"]
    assert diff_components(a.components, a.components) == []


def test_env_component_has_versions_and_code():
    from adstore.integration.reference.stages import BuildModel, ExportToGraph

    env = env_component([BuildModel, ExportToGraph])
    assert env["adstore_format"] == FORMAT_VERSION
    assert env["torch"] == torch.__version__
    assert set(env["code"]) == {
        "adstore.integration.reference.stages.BuildModel",
        "adstore.integration.reference.stages.ExportToGraph",
    }


def test_code_fingerprint_follows_the_source(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    src = "class Step:\n    code_modules = ()\n    def apply(self):\n        return {}\n"
    path = tmp_path / "fp_mod_a.py"
    path.write_text(src)
    mod = importlib.import_module("fp_mod_a")
    before = code_fingerprint([mod.Step])
    assert before == code_fingerprint([mod.Step])
    path.write_text(src.replace("{}", "{'changed': 1}"))  # an edited helper body, same class name
    importlib.reload(mod)
    after = code_fingerprint([mod.Step])
    assert list(after) == list(before) == ["fp_mod_a.Step"]
    assert after != before
