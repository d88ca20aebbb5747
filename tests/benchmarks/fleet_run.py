"""One start of a user's own ``torch.compile`` model on a simulated fleet host: interpreter start to first output.

The model is a user's, not the reference pipeline's: two small MLP-Mixer
blocks (token mixing and channel mixing over a 2 x 16 x 32 input, seeded
weights), compiled with plain ``torch.compile`` after
``adstore.integration.inductor.enable()`` (unless ``--no-adstore``).  It
prints ``FIRST {"sha": ...}`` as soon as the first compiled output exists,
then one JSON line: Inductor's cache counters, adstore's fail-opens, the
store's ``inductor.*``/``remote.*`` counters and adstore's warnings (a miss
that remains names its cause there).

Compiler runs are counted outside this process, by the audit hook of
``vllm_builds/sitecustomize.py`` on ``PYTHONPATH`` (every ``g++ ... -o``).

    python fleet_run.py [--no-adstore]
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from typing import Any

__all__ = ["mixer"]


def mixer() -> tuple[Any, tuple[Any, ...]]:
    """Two MLP-Mixer blocks and a linear head on a (2, 16, 32) input, seeded: a user's model, built here."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, tokens: int = 16, channels: int = 32) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(channels)
            self.tokens = nn.Sequential(nn.Linear(tokens, 4 * tokens), nn.GELU(), nn.Linear(4 * tokens, tokens))
            self.norm2 = nn.LayerNorm(channels)
            hidden = 4 * channels
            self.channels = nn.Sequential(nn.Linear(channels, hidden), nn.GELU(), nn.Linear(hidden, channels))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
            return x + self.channels(self.norm2(x))

    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(Block(), Block())
            self.head = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x).mean(1))

    torch.manual_seed(0)
    return Mixer().eval(), (torch.randn(2, 16, 32),)


def main() -> int:
    import torch

    adstore = "--no-adstore" not in sys.argv
    warnings: list[str] = []
    enabled = None
    if adstore:
        from adstore.integration import inductor

        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("adstore").addHandler(handler)
        enabled = inductor.enable()
    model, inputs = mixer()
    with torch.no_grad():
        out = torch.compile(model)(*inputs)
    print("FIRST " + json.dumps({"sha": hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest()}), flush=True)

    from torch._dynamo.utils import counters

    info: dict[str, Any] = {
        "enabled": enabled,
        "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
        "aot_autograd": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    }
    if adstore:
        from adstore.integration import inductor

        info["failopen"] = dict(inductor.FAILOPEN)
        entries = inductor.active()
        if entries is not None:
            entries.store.flush()
            info["store"] = {
                k: v for k, v in entries.store.stats().counters.items() if k.startswith(("inductor.", "remote."))
            }
        inductor.disable()  # pushes finish and the store closes here, as at a user's exit
        info["warnings"] = warnings
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
