"""Simulated hosts of the engine-cache remote tests: each compiles or restores in its own spawned process.

Test modules and the remote benchmark import from here (never from ``conftest``).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

__all__ = ["engine_host"]


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()


def engine_host(root: str, env: dict[str, str], seed: int = 1) -> dict[str, Any]:
    """One host: ``compile()`` a small MLP through ``StoreEngineStorage.from_env()`` and run it once.

    ``env`` names the store root's remote tier (``ADSTORE_REMOTE*`` and keys);
    returns the engine's event, how many compiles ran, a digest of the output,
    whether it equals eager, and the store's ``remote.*`` counters.
    """
    os.environ.update(env, ADSTORE_ROOT=root)
    import torch

    from adstore.integration.engine.cache import EngineCache
    from adstore.integration.engine.storage import StoreEngineStorage

    model = _model(seed)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    backend = StoreEngineStorage.from_env()
    front = EngineCache(backend)
    try:
        engine = front.compile(model, (x,))
        with torch.no_grad():
            out = engine(x)
            eager = model(x)
        counters = {k: v for k, v in backend.store.stats().counters.items() if k.startswith("remote.")}
    finally:
        front.close()
        backend.close()
    return {
        "kind": str(engine.event.kind),
        "reason": None if engine.event.reason is None else str(engine.event.reason),
        "source": str(engine.event.source),
        "transferred": engine.event.transferred,
        "compiles": front.counters["compiles"],
        "hash": engine.hash,
        "output": hashlib.sha256(out.detach().contiguous().numpy().tobytes()).hexdigest(),
        "matches_eager": bool(torch.allclose(out, eager, atol=1e-5)),
        "counters": counters,
    }
