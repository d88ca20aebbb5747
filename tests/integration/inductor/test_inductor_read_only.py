"""Inductor's entries on a read-only store: a hit is still a hit, a save is a fail-open ``read_only``.

The store's behaviour on a real read-only mount is ``tests/store/test_read_only.py``'s; here the store
is opened ``read_only=True``, which refuses writes the same way, and Inductor's backend meets it.
"""

from __future__ import annotations

import os

import pytest

from adstore.integration.inductor.entries import FAILOPEN, InductorEntries
from adstore.store import Store

pytest.importorskip("torch")

ME = frozenset({os.geteuid(), 0})
FX = "inductor_fx_graph"


def test_a_read_only_store_serves_inductor_hits_and_a_save_fails_open_as_read_only(tmp_path):
    value = b'{"data": "' + os.urandom(8 << 10).hex().encode() + b'"}'
    with Store.open(tmp_path / "store") as store:
        InductorEntries(store, trusted=ME, owns_store=False).put(FX, "pt2:fx-graph-v1::k:c1", value)
    with Store.open(tmp_path / "store", read_only=True) as store:
        entries = InductorEntries(store, trusted=ME, owns_store=False)
        assert entries.get(FX, "pt2:fx-graph-v1::k:c1") == value  # a hit is still a hit
        before, corrupt = FAILOPEN["read_only"], FAILOPEN["corrupt_index"]
        entries.put(FX, "pt2:fx-graph-v1::k2:c1", value)  # never raises into torch.compile
        assert FAILOPEN["read_only"] == before + 1 and FAILOPEN["corrupt_index"] == corrupt
        assert entries.get(FX, "pt2:fx-graph-v1::k2:c1") is None
        counters = store.stats().counters  # counted in memory: the store writes nothing
        assert counters["inductor.failopen.read_only"] == 1 and counters["hits"] == 1
    with Store.open(tmp_path / "store") as store:
        assert "inductor.failopen.read_only" not in store.stats().counters
