"""A pipeline built in a fresh process: ``python env_child.py ROOT OUT`` writes its cache events to OUT.

``test_envcheck`` runs it under other environments (a simulated torch, another
installed transformers, another host name and working directory) against the
entry it built itself.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
from torch import nn

from adstore.integration import cached_prefix

__all__ = ["KEY", "build", "main"]

KEY = {"model": {"arch": "two-linears", "hidden": 4}, "prefix": [{"name": "build"}]}


def build() -> nn.Module:
    """The pre-weight-loading module: parameters on meta."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def main(argv: list[str]) -> int:
    root, out = argv
    result = cached_prefix(KEY, build, root=root)
    Path(out).write_text(
        json.dumps(
            {
                "events": [e.to_dict() for e in result.events],
                "key": result.key,
                "host": socket.gethostname(),
                "cwd": os.getcwd(),
                "pid": os.getpid(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
