"""The sharding plan's patterns match whole ASCII module paths (``*`` is a layer number in ASCII digits)."""

from __future__ import annotations

import pytest

from adstore.integration.reference.sharding import _plan_regex, _style_for

PLAN = _plan_regex({"model.layers.*.mlp.up_proj": "colwise", "lm_head": "colwise_gather"})


@pytest.mark.parametrize(
    "owner", ["model.layers.١.mlp.up_proj", "model.layers.１.mlp.up_proj", "lm_head\n", "model.layers.1.mlp.up_proj\n"]
)
def test_a_path_that_is_not_whole_ascii_matches_nothing(owner):
    assert _style_for("model.layers.12.mlp.up_proj", PLAN) == "colwise" and _style_for("lm_head", PLAN)
    assert _style_for(owner, PLAN) is None
