"""The compile stage's key covers the code of what the user hands it, never only a name.

A warm restart finds its engine through the index key and never exports
again, so whatever changes the engine must change that key: a decomposition
(lowering) applied before compiling, by its source and what it captures, and
a custom Inductor pass set in the global configuration.  The same code must
give the same key in every process, or no restart would ever hit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_LOWERINGS = """
import functools
import torch

def gelu_lowering(x, approximate="none"):
    return x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))

def make_gelu(approximate):
    def gelu(x):
        return torch.nn.functional.gelu(x, approximate=approximate)
    return gelu

def custom_pass(graph):
    return None
"""

_KEYS = """
import json, sys
import torch
sys.path.insert(0, {dir!r})
import torch._inductor.config
import lowerings
from adstore.integration.engine.stage import EngineStage
from adstore.integration.coordination.dist import Topology

keys = {{}}
for what in {whats!r}:  # the custom pass (global configuration) last
    decompositions = None
    if what == "custom_pass":
        torch._inductor.config.post_grad_custom_post_pass = lowerings.custom_pass
    elif what.startswith("make_gelu:"):
        decompositions = {{torch.ops.aten.gelu.default: lowerings.make_gelu(what.split(":")[1])}}
    else:
        decompositions = {{torch.ops.aten.gelu.default: getattr(lowerings, what)}}
    stage = EngineStage(prefix={{"key": "a" * 64, "snapshot": "b" * 64}}, decompositions=decompositions)
    keys[what] = stage.key((torch.zeros(2, 8),), Topology(0, 1)).key
print(json.dumps(keys))
"""

ALL = ["gelu_lowering", "make_gelu:tanh", "make_gelu:none", "custom_pass"]


def _keys(directory, whats) -> dict[str, str]:
    """The stage's index key for each of ``whats``, computed in one fresh process."""
    script = _KEYS.format(dir=str(directory), whats=list(whats))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _lowerings(directory, edit: tuple[str, str] | None = None):
    text = textwrap.dedent(_LOWERINGS)
    (directory / "lowerings.py").write_text(text.replace(*edit) if edit else text)
    return directory


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The keys of every case, computed in two processes."""
    directory = _lowerings(tmp_path_factory.mktemp("lowerings"))
    return _keys(directory, ALL), _keys(directory, ALL)


def test_two_lowerings_of_one_op_made_by_one_factory_have_different_keys(first):
    assert first[0]["make_gelu:tanh"] != first[0]["make_gelu:none"], "the captured value changes the lowering"


def test_an_edited_lowering_changes_the_key_and_the_same_one_keeps_it_in_every_process(first, tmp_path):
    lowered = ["gelu_lowering", "make_gelu:tanh", "make_gelu:none"]
    assert [first[0][w] for w in lowered] == [first[1][w] for w in lowered]
    # Someone edits the lowering (same op, same function name): the engine must be compiled again.
    edited = _keys(_lowerings(tmp_path, ("0.7071067811865476", "0.7071")), ["gelu_lowering"])
    assert edited["gelu_lowering"] != first[0]["gelu_lowering"]


def test_a_custom_inductor_pass_is_keyed_by_its_code(first, tmp_path):
    assert first[0]["custom_pass"] == first[1]["custom_pass"], "the same pass must give the same key in every process"
    edited = _keys(_lowerings(tmp_path, ("return None", "graph.lint()\n    return None")), ["custom_pass"])
    assert edited["custom_pass"] != first[0]["custom_pass"]
