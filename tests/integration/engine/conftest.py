"""The engine-cache tests' shared first compile: one real AOTInductor compile for all their modules.

Real compiles are expensive (tens of seconds on 2 cores), so the store, the
backend and the first ``compile()`` of the MLP (a miss) are made once per
session and shared by every ``test_engine_*`` module here (they were one
module-scoped fixture when those tests were one module).
"""

from __future__ import annotations

import warnings

import pytest
from engine_support import X, digests, make_model

from adstore.integration.engine.cache import EngineCache
from adstore.integration.engine.storage import StoreEngineStorage
from adstore.store import Store


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    """One store, one backend, and the one shared first compile (a miss)."""
    root = tmp_path_factory.mktemp("engine-store")
    store = Store.open(root, grace_period=0.0)
    backend = StoreEngineStorage(store)
    model = make_model(1)
    before = digests(model)
    front = EngineCache(backend)
    with warnings.catch_warnings(record=True) as caught:  # what a user of compile() sees
        warnings.simplefilter("always")
        engine = front.compile(model, (X,))
    yield {
        "warnings": [str(w.message) for w in caught],
        "store": store,
        "backend": backend,
        "front": front,
        "model": model,
        "before": before,
        "engine": engine,
        "hash": engine.hash,
        "blob": backend.load(engine.hash),
    }
    front.close()
    store.close()
