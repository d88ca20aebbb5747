"""Simulated hosts of the ``aot_compile`` tests: a small module compiled and called in a fresh spawned process.

A host is the environment of :func:`inductor_hosts.host_env` (store root,
Inductor cache directory, ``TMPDIR``); :func:`aot_host` runs ``aot_compile``
there and reports what happened: the outcome, the C++ builds, the outputs
(against eager), a weight changed in place, and a call outside the guards.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch
from torch import nn

__all__ = ["Small", "aot_host", "small_inputs"]


class Small(nn.Module):
    """A linear layer, a buffer and a keyword scalar: parameters, buffers and kwargs in one small graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor, *, bias: float = 1.0) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale + bias


def small_inputs() -> tuple[Small, torch.Tensor]:
    torch.manual_seed(0)
    return Small().eval(), torch.randn(4, 8)


def aot_host(env: dict[str, str], others: bool = True, inline_threshold: int | None = None) -> dict[str, Any]:
    """``aot_compile`` of :class:`Small` under ``env``, in this (fresh) process; what it did and computed.

    ``others``: also change a weight in place and call with another scalar
    (a guard failure: ``torch.compile`` serves it, one more compile).
    ``inline_threshold``: the store's (0 keeps every blob a file).
    """
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None  # TMPDIR is read again
    from inductor_hosts import count_builds

    builds = count_builds()
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("adstore").addHandler(handler)

    from adstore.integration.inductor import FAILOPEN, aot_compile
    from adstore.store import Store

    store = Store.from_env(**({} if inline_threshold is None else {"inline_threshold": inline_threshold}))
    model, x = small_inputs()
    with torch.no_grad():
        compiled = aot_compile(model, (x,), {"bias": 1.0}, store=store)
        out = compiled(x, bias=1.0)
        eager = model(x, bias=1.0)
    result: dict[str, Any] = {
        "outcome": compiled.outcome,
        "reason": compiled.reason,
        "key": compiled.key,
        "output": hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest(),
        "equals_eager": bool(torch.allclose(out, eager, atol=1e-5)),
        "builds": [b for b in builds if not b.endswith(".i")],  # g++ -E of the header runs in every process
    }
    if others:
        with torch.no_grad():
            model.lin.weight.add_(0.25)  # in place: the artifact reads the module's live parameters
            result["live_weights"] = bool(torch.allclose(compiled(x, bias=1.0), model(x, bias=1.0), atol=1e-5))
            result["fallbacks_before"] = compiled.fallbacks
            other = compiled(x, bias=2.5)  # the scalar was specialised: a guard fails
            result["other_scalar"] = bool(torch.allclose(other, model(x, bias=2.5), atol=1e-5))
            compiled(x, bias=3.5)
            result["fallbacks"] = compiled.fallbacks
    store.flush()
    result["store"] = {k: v for k, v in store.stats().counters.items() if k.startswith(("aot.", "remote.", "misses."))}
    store.close()
    result["failopen"] = dict(FAILOPEN)
    result["warnings"] = warnings
    return result
