"""The one publish path, ``Store.save``: publish, agree, commit; any failure leaves nothing published.

Ranks saving together pass their collective as ``agree``: it must be called
exactly once on every rank whatever happened there (a rank that skips it
leaves its peers waiting), and a "no" from it must leave nothing behind.
"""

from __future__ import annotations

import pytest

from adstore.store import Store


@pytest.fixture
def store(tmp_path):
    with Store.open(tmp_path / "store") as s:
        yield s


def _nothing_left(store: Store, key: str) -> bool:
    return store.entry(key) is None and store.manifests(key) == [] and not store.lookup(key, count=False).hit


class Collective:
    """Stands in for ``dist.all_true`` between ranks: records what this rank said, answers ``verdict``."""

    def __init__(self, verdict: bool | None = None, error: Exception | None = None) -> None:
        self.heard: list[bool] = []
        self.verdict, self.error = verdict, error

    def __call__(self, ok: bool) -> bool:
        self.heard.append(ok)
        if self.error is not None:
            raise self.error
        return ok if self.verdict is None else self.verdict


def test_a_save_commits_what_it_publishes(store):
    agree = Collective()
    manifest = store.save("k1", {"a": store.put_bytes(b"x" * 100)}, namespace="ns", agree=agree)
    assert agree.heard == [True]
    assert manifest is not None and manifest.committed and manifest.namespace == "ns"
    assert store.lookup("k1", count=False).hit


def test_a_rank_whose_blobs_fail_still_joins_the_agreement_once_and_leaves_nothing(store):
    def blobs():
        raise OSError(28, "No space left on device")

    agree = Collective()
    with pytest.raises(OSError, match="No space"):
        store.save("k2", blobs, agree=agree)
    assert agree.heard == [False]
    assert _nothing_left(store, "k2")


def test_a_peer_that_failed_makes_the_save_abort_what_this_rank_published(store):
    agree = Collective(verdict=False)
    assert store.save("k3", {"a": store.put_bytes(b"y" * 100)}, agree=agree) is None
    assert agree.heard == [True]
    assert _nothing_left(store, "k3")


def test_a_collective_that_fails_after_the_publish_aborts_it(store):
    agree = Collective(error=RuntimeError("gloo: connection reset by peer"))
    with pytest.raises(RuntimeError, match="gloo"):
        store.save("k4", {"a": store.put_bytes(b"z" * 100)}, agree=agree)
    assert agree.heard == [True]
    assert _nothing_left(store, "k4")
