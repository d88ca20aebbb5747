"""The contract suite's model (module ``contract_model``), written as source into a directory per variant.

The suite imports it in child processes from that directory as the module
``contract_model``, so an edit of its code (:func:`source` with ``edit``) is
the same module name and class names with other code, as a user's edit is.
What the suite changes at run time (a function-valued attribute, a global
``forward`` reads, a closure cell) is an argument of :func:`build` or a
global the child sets, never a source edit: those are the changes a key
built from source alone misses.

The model holds what ordinary models hold and the tiers have tripped over:
a convolution (``_ConvNd.__init__`` keeps a set constant whose order
follows ``PYTHONHASHSEED``), batch norm, a submodule of another class, a
function-valued attribute, a closure and a module global.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["source", "write"]

_TEMPLATE = '''\
"""Written by tests/integration/contract/model_source.py; edited per variant."""

import torch
from torch import nn

#: A global forward reads on every call.
SCALE = 1.0


def make_post(k):
    def post(t):
        return t * k

    return post


class Block(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.act = act

    def forward(self, x):
        return self.act(self.norm(self.conv(x))){block_edit}


class Model(nn.Module):
    def __init__(self, act=torch.tanh, k=2.0):
        super().__init__()
        self.block = Block(act)
        self.head = nn.Linear(4 * 6 * 6, 5)
        self.post = make_post(k)

    def forward(self, x, bias=0.5):
        y = self.block(x).flatten(1)
        return self.post(self.head(y)){model_edit} * SCALE + bias


ACTS = {{"tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu}}


def build(act="tanh", k=2.0, dtype="float32"):
    torch.manual_seed(0)
    model = Model(ACTS[act], k).eval()
    with torch.no_grad():  # batch norm statistics that matter
        model.block.norm.running_mean.uniform_(-0.5, 0.5)
        model.block.norm.running_var.uniform_(0.5, 1.5)
    return model.to(getattr(torch, dtype))
'''

#: Source edits by name: (text appended in Block.forward, text appended in Model.forward).
EDITS = {"": ("", ""), "model": ("", " - 0.25"), "block": (" * 0.5", "")}


def source(edit: str = "") -> str:
    """The module's source with ``edit`` applied (``""``: the original)."""
    block_edit, model_edit = EDITS[edit]
    return _TEMPLATE.format(block_edit=block_edit, model_edit=model_edit)


def write(directory: Path, edit: str = "") -> Path:
    """``directory/contract_model.py`` with ``edit`` applied; the directory to put on ``sys.path``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "contract_model.py").write_text(source(edit))
    directory.chmod(0o755)
    (directory / "contract_model.py").chmod(0o644)
    return directory
