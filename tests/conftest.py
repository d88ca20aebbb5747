"""Shared fixtures: every test gets its own store root under pytest's tmp_path."""

from __future__ import annotations

import os
import time

import pytest

from adstore.store import ManualClock, Store


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Past ``ADSTORE_TEST_DEADLINE`` (seconds since the epoch; CI's slow tier sets it) a test is skipped, not started.

    CI gives the slow tier what is left of its 90 minutes; a test that could not finish in that time
    is reported as skipped with this reason (so the run says what it did not do), never killed halfway.
    """
    deadline = os.environ.get("ADSTORE_TEST_DEADLINE", "").strip()
    if deadline and time.time() > float(deadline):
        pytest.skip("not started: the CI time budget of this run is spent (ADSTORE_TEST_DEADLINE)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The contract suite's matrix (every tier × every row, then the zoo) runs after every other test.

    Its slow rows take hours on 2 cores, more than CI's slow tier has left: run last, a deadline
    skips the matrix's tail, not the stress tests and each tier's own checks that come before it.
    Module-scoped fixtures keep their grouping (a stable sort moves whole modules).
    """
    items.sort(key=lambda item: ("contract" in item.path.parts, "zoo" in item.name))


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
