"""Shared fixtures: every test gets its own store root under pytest's tmp_path."""

from __future__ import annotations

import pytest

from adstore.store import ManualClock, Store


@pytest.fixture(autouse=True, scope="session")
def _miss_log(tmp_path_factory):
    """Keys Inductor missed are journalled for ``adstore explain``: under the session's tmp, never in ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("ADSTORE_MISS_LOG", str(tmp_path_factory.mktemp("misses") / "misses.jsonl"))
    yield
    mp.undo()


@pytest.fixture
def store_root(tmp_path, monkeypatch):
    root = tmp_path / "store"
    monkeypatch.setenv("ADSTORE_ROOT", str(root))
    return root


@pytest.fixture
def clock():
    """The store's clock, moved by the test (``clock.advance(seconds)``) instead of sleeping."""
    return ManualClock()


@pytest.fixture
def store(store_root, clock):
    s = Store.open(store_root, grace_period=0.0, clock=clock)
    yield s
    s.close()
