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

__all__ = [
    "Normed",
    "Scaled",
    "Small",
    "aot_host",
    "conv_host",
    "conv_inputs",
    "normed_host",
    "scaled_host",
    "small_inputs",
    "unsafe_host",
]

#: A module-level global :class:`Scaled` reads in ``forward`` (Dynamo's guard on it cannot be stored).
SCALE = 2.0


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


class Scaled(nn.Module):
    """A function-valued attribute and a global read in ``forward``: what the key must hold by value."""

    def __init__(self, act: Any = torch.tanh) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)) * SCALE


def conv_inputs() -> tuple[nn.Module, torch.Tensor]:
    """A convolution with batch norm in an ``nn.Sequential``: torch's own forward, a frozenset constant in its code."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    return model, torch.randn(1, 3, 6, 6)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def conv_host(env: dict[str, str]) -> dict[str, Any]:
    """``aot_compile`` of :func:`conv_inputs` under ``env`` (its ``PYTHONHASHSEED`` is the spawned process's)."""
    import warnings

    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None
    from inductor_hosts import count_builds

    builds = count_builds()
    from adstore.integration.inductor import FAILOPEN, aot_compile
    from adstore.store import Store

    store = Store.from_env()
    model, x = conv_inputs()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = aot_compile(model, (x,), store=store)
        out = compiled(x)
    eager = model(x)
    store.flush()
    counters = {k: v for k, v in store.stats().counters.items() if k.startswith(("aot.", "misses."))}
    store.close()
    return {
        "outcome": compiled.outcome,
        "reason": compiled.reason,
        "key": compiled.key,
        "seed": os.environ.get("PYTHONHASHSEED"),
        "output": _digest(out),
        "equals_eager": bool(torch.allclose(out, eager, atol=1e-5)),
        "builds": [b for b in builds if not b.endswith(".i")],
        "fallbacks": compiled.fallbacks,
        "future_warnings": [str(w.message) for w in caught if issubclass(w.category, FutureWarning)],
        "failopen": dict(FAILOPEN),
        "store": counters,
    }


def scaled_host(env: dict[str, str]) -> dict[str, Any]:
    """:class:`Scaled` compiled, then its global and its activation changed; each call against eager of the changed
    module."""
    global SCALE
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None
    from adstore.integration.inductor import FAILOPEN, aot_compile
    from adstore.store import Store

    store = Store.from_env()
    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(4, 8)

    def error(compiled: Any) -> float:
        return float((compiled(x) - model(x)).abs().max())

    with torch.no_grad():
        compiled = aot_compile(model, (x,), store=store)
        result: dict[str, Any] = {"outcome": compiled.outcome, "first": error(compiled)}
        SCALE = 3.0  # what torch.compile would recompile for
        result["global_changed"] = error(compiled)
        SCALE = 2.0
        again = aot_compile(model, (x,), store=store)  # the entry of SCALE = 2.0, loaded
        result["again"] = (again.outcome, error(again), again.fallbacks)
        model.act = torch.sigmoid  # an ID_MATCH guard torch cannot store
        result["act_changed"] = (error(again), again.fallbacks)
    store.close()
    result["failopen"] = dict(FAILOPEN)
    return result


def unsafe_host(env: dict[str, str]) -> dict[str, Any]:
    """``aot_compile`` of :class:`Small` under ``env`` without calling it: what it decided, and why."""
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None
    from adstore.integration.inductor import FAILOPEN, aot_compile

    model, x = small_inputs()
    compiled = aot_compile(model, (x,), {"bias": 1.0})
    return {"outcome": compiled.outcome, "reason": compiled.reason, "failopen": dict(FAILOPEN)}


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


#: A module-level ``nn.Module`` that :class:`Normed` calls: torch pickles the globals its code reads by value,
#: and refuses a module among them (``Failed to serialize``), so no artifact of ``Normed`` can be written.
NORM = nn.LayerNorm(8)


class Normed(nn.Module):
    """A module whose ``forward`` calls a global ``nn.Module``: an artifact torch cannot write."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NORM(self.lin(x))


def normed_host(env: dict[str, str]) -> dict[str, Any]:
    """``aot_compile`` of :class:`Normed` under ``env``: what it did, its C++ builds, whether it is right."""
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None
    from inductor_hosts import count_builds

    builds = count_builds()
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("adstore").addHandler(handler)
    from adstore.integration.inductor import FAILOPEN, active, aot_compile, disable

    torch.manual_seed(0)
    model, x = Normed().eval(), torch.randn(4, 8)
    with torch.no_grad():
        compiled = aot_compile(model, (x,))
        out = compiled(x)
        eager = model(x)
    enabled = active() is not None
    disable()  # what the process does at exit (a pool worker runs no atexit): keep what it built
    return {
        "outcome": compiled.outcome,
        "reason": compiled.reason,
        "equals_eager": bool(torch.allclose(out, eager, atol=1e-5)),
        "enabled": enabled,
        "builds": [b for b in builds if not b.endswith(".i")],  # g++ -E of the header runs in every process
        "failopen": dict(FAILOPEN),
        "warnings": [w for w in warnings if "unstorable_module" in w],
    }
